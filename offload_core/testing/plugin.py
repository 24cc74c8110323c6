"""pytest plugin (entry point ``pytest11``): ``--backend=NAME`` and the backend fixtures.

Every test suite that uses offload-core, including the conformance kit in this package
(``pytest --backend=NAME --pyargs offload_core.testing``), gets:

* ``backend_name`` — the name given with ``--backend`` (default ``fake``);
* ``backend`` — one instance for the whole session, in chaos mode when the backend supports it
  (:data:`SimulatorCapability.CHAOS`) and with its race sanitizer on when it has one
  (:data:`SimulatorCapability.SANITIZE`), so that a missing wait fails every time;
* ``new_backend(**options)`` — a factory for extra, independently configured instances of the
  same backend (a capacity, a bandwidth), closed when the test ends; chaos and sanitizer on alike.

With ``--backend=fake`` the sanitizer is on for every fake backend the tests build themselves too
(``OFFLOAD_CORE_FAKE_SANITIZE=1`` unless the environment sets it), spawned processes included. A
test that races on purpose, or runs code the sanitizer cannot follow, opts out with
``@pytest.mark.unsanitized("why")``.

Installing offload-core registers this plugin for every pytest run on the machine, so without
``--backend`` it stays out of the way: it imports neither offload_core's strategies nor torch,
changes no environment variable and prints no header line; its fixtures and markers still work
(on the fake backend) and import what they need when a test uses them.

Only ``--backend`` selects the backend here: ``OFFLOAD_CORE_BACKEND`` is deliberately ignored, so
that a stray environment variable cannot silently change what a test run validated.

Two markers let one test suite run on every backend (``pytest --backend=cuda`` on a GPU machine):

* ``@pytest.mark.fake_only`` — the test needs the fake simulator itself (its options, such as a
  pinned-memory cap or ``pinned_rounding``, or its internals): skipped under any other backend;
* ``@pytest.mark.requires_capability(*names)`` — the test needs these
  :class:`~offload_core.Capability` or :class:`SimulatorCapability` names (``chaos``,
  ``capacity``, ...): skipped where the selected backend lacks one.

:func:`selected_backend` names the backend of the run, for helpers that build one outside a
fixture.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import pytest

from .capabilities import SimulatorCapability

DEFAULT_BACKEND = "fake"
SANITIZE_ENV = "OFFLOAD_CORE_FAKE_SANITIZE"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("offload_core", "offload-core backends")
    group.addoption(
        "--backend",
        action="store",
        default=None,
        metavar="NAME",
        help=f"offload-core backend the tests run on (default: {DEFAULT_BACKEND}); "
        "`offload-core backends` lists the registered names",
    )


def _info(name: str):
    from offload_core.base.errors import BackendNotFoundError
    from offload_core.device.plugins import registry

    try:
        return registry().info(name)
    except BackendNotFoundError as exc:
        raise pytest.UsageError(f"--backend={name}: {exc}") from None


_selected = DEFAULT_BACKEND


def _name(config: pytest.Config) -> str:
    return config.getoption("backend") or DEFAULT_BACKEND


def selected_backend() -> str:
    """The backend name this test run selected with ``--backend`` (``fake`` outside pytest, or
    in a process the run spawned)."""
    return _selected


def pytest_configure(config: pytest.Config) -> None:
    global _selected
    config.addinivalue_line("markers", "fake_only: needs the fake simulator itself; skipped under other backends")
    config.addinivalue_line(
        "markers", "requires_capability(*names): needs these backend capabilities; skipped where one is missing"
    )
    config.addinivalue_line(
        "markers", "unsanitized(reason): run without the race sanitizer (a deliberate race, or code it cannot follow)"
    )
    name = config.getoption("backend")
    if name is None:  # not asked for: nothing imported, nothing set
        return
    # Fail before collection, as a usage error (exit code 4, no traceback), for a name that is
    # unknown or cannot run here: every test would otherwise error on the same cause.
    info = _info(name)
    if not info.available:
        reason = info.unavailable_reason()
        raise pytest.UsageError(f"--backend={name}: backend {name!r} is not available here" + (f": {reason}" if reason else ""))
    _selected = name
    if name == "fake":
        os.environ.setdefault(SANITIZE_ENV, "1")


def pytest_runtest_setup(item: pytest.Item) -> None:
    name = _name(item.config)
    if name != "fake" and item.get_closest_marker("fake_only") is not None:
        pytest.skip(f"needs the fake backend, not {name!r}")
    for marker in item.iter_markers("requires_capability"):
        missing = [c for c in marker.args if c not in _info(name).cls.capabilities]
        if missing:
            pytest.skip(f"backend {name!r} lacks capability {', '.join(missing)}")


def _defaults(cls: type) -> dict[str, Any]:
    """The options that make a backend strict: chaos and the sanitizer, where it has them."""
    options: dict[str, Any] = {}
    if SimulatorCapability.CHAOS in cls.capabilities:
        options["chaos"] = True
    if SimulatorCapability.SANITIZE in cls.capabilities:
        options["sanitize"] = True
    return options


@pytest.fixture(autouse=True)
def _unsanitized(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``@pytest.mark.unsanitized``: fake backends built in the test run without the sanitizer,
    and the test's own torch operations are not recorded."""
    if request.node.get_closest_marker("unsanitized") is None:
        yield
        return
    monkeypatch.setenv(SANITIZE_ENV, "0")
    try:
        from offload_core_fake.sanitizer import paused
    except ImportError:  # the fake backend is not installed: nothing to pause
        yield
        return
    with paused():
        yield


def pytest_report_header(config: pytest.Config) -> list[str]:
    name = config.getoption("backend")
    if name is None:
        return []
    from offload_core.base.errors import BackendNotFoundError
    from offload_core.device.plugins import registry

    info = _info(name)
    modes = [m for m, cap in (("chaos mode", SimulatorCapability.CHAOS), ("race sanitizer", SimulatorCapability.SANITIZE))
             if cap in info.cls.capabilities]
    mode = f" ({', '.join(modes)})" if modes else ""
    caps = ", ".join(sorted(info.cls.capabilities)) or "none"
    lines = [f"offload_core backend: {name}{mode} from {info.source}; capabilities: {caps}"]
    for failure in registry().failures:
        lines.append(f"offload_core plugin skipped: {failure.entry_point} ({failure.source}): {failure.error}")
    return lines


@pytest.fixture(scope="session")
def backend_name(pytestconfig: pytest.Config) -> str:
    """The backend name selected with ``--backend`` (default ``fake``)."""
    return _name(pytestconfig)


@pytest.fixture(scope="session")
def backend(backend_name: str) -> Iterator[Any]:
    """The session's backend instance; chaos mode and the sanitizer on where the backend has them."""
    from offload_core import get_backend

    options = _defaults(_info(backend_name).cls)
    if options:
        instance = get_backend(backend_name, **options)  # a private instance: ours to close
        try:
            yield instance
        finally:
            instance.close()
    else:
        yield get_backend(backend_name)  # the process-wide shared instance: not ours to close


@pytest.fixture
def new_backend(backend_name: str, request: pytest.FixtureRequest) -> Iterator[Callable[..., Any]]:
    """Factory: ``new_backend(**options)`` builds a fresh instance of the selected backend.

    Chaos mode and the sanitizer are added where the backend has them unless given (the sanitizer
    not in a test marked ``unsanitized``). Every instance is closed at the end of the test.
    """
    from offload_core import get_backend

    cls = _info(backend_name).cls
    made: list[Any] = []
    defaults = _defaults(cls)
    if request.node.get_closest_marker("unsanitized") is not None:
        defaults.pop("sanitize", None)

    def make(**options: Any) -> Any:
        options = {**defaults, **options}
        instance = get_backend(backend_name, **options) if options else cls()
        made.append(instance)
        return instance

    try:
        yield make
    finally:
        for instance in made:
            instance.close()
