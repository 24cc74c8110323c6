"""pytest plugin (entry point ``pytest11``): ``--backend=NAME`` and the backend fixtures.

Every test suite that uses offload-core, including the conformance kit in this package
(``pytest --backend=NAME --pyargs offload_core.testing``), gets:

* ``backend_name`` — the name given with ``--backend`` (default ``fake``);
* ``backend`` — one instance for the whole session, in chaos mode when the backend supports it
  (:data:`offload_core.Capability.CHAOS`), so that a missing wait fails every time;
* ``new_backend(**options)`` — a factory for extra, independently configured instances of the
  same backend (a capacity, a bandwidth), closed when the test ends.

Only ``--backend`` selects the backend here: ``OFFLOAD_CORE_BACKEND`` is deliberately ignored, so
that a stray environment variable cannot silently change what a test run validated.

Two markers let one test suite run on every backend (``pytest --backend=cuda`` on a GPU machine):

* ``@pytest.mark.fake_only`` — the test needs the fake simulator itself (its options, such as a
  pinned-memory cap or ``pinned_rounding``, or its internals): skipped under any other backend;
* ``@pytest.mark.requires_capability(*names)`` — the test needs these
  :class:`~offload_core.Capability` names (``chaos``, ``capacity``, ...): skipped where the
  selected backend lacks one.

:func:`selected_backend` names the backend of the run, for helpers that build one outside a
fixture.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

DEFAULT_BACKEND = "fake"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("offload_core", "offload-core backends")
    group.addoption(
        "--backend",
        action="store",
        default=DEFAULT_BACKEND,
        metavar="NAME",
        help=f"offload-core backend the tests run on (default: {DEFAULT_BACKEND}); "
        "`offload-core backends` lists the registered names",
    )


def _info(name: str):
    from offload_core.plugins import BackendNotFoundError, registry

    try:
        return registry().info(name)
    except BackendNotFoundError as exc:
        raise pytest.UsageError(f"--backend={name}: {exc}") from None


_selected = DEFAULT_BACKEND


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
    # Fail before collection, as a usage error (exit code 4, no traceback), for a name that is
    # unknown or cannot run here: every test would otherwise error on the same cause.
    name = config.getoption("backend")
    info = _info(name)
    if not info.available:
        reason = info.unavailable_reason()
        raise pytest.UsageError(f"--backend={name}: backend {name!r} is not available here" + (f": {reason}" if reason else ""))
    _selected = name


def pytest_runtest_setup(item: pytest.Item) -> None:
    name = item.config.getoption("backend")
    if name != "fake" and item.get_closest_marker("fake_only") is not None:
        pytest.skip(f"needs the fake backend, not {name!r}")
    capabilities = _info(name).cls.capabilities
    for marker in item.iter_markers("requires_capability"):
        missing = [c for c in marker.args if c not in capabilities]
        if missing:
            pytest.skip(f"backend {name!r} lacks capability {', '.join(missing)}")


def pytest_report_header(config: pytest.Config) -> list[str]:
    from offload_core import Capability
    from offload_core.plugins import registry

    name = config.getoption("backend")
    info = _info(name)
    mode = " (chaos mode)" if Capability.CHAOS in info.cls.capabilities else ""
    caps = ", ".join(sorted(info.cls.capabilities)) or "none"
    lines = [f"offload_core backend: {name}{mode} from {info.source}; capabilities: {caps}"]
    for failure in registry().failures:
        lines.append(f"offload_core plugin skipped: {failure.entry_point} ({failure.source}): {failure.error}")
    return lines


@pytest.fixture(scope="session")
def backend_name(pytestconfig: pytest.Config) -> str:
    """The backend name selected with ``--backend``."""
    return pytestconfig.getoption("backend")


@pytest.fixture(scope="session")
def backend(backend_name: str) -> Iterator[Any]:
    """The session's backend instance; chaos mode on where the backend has it."""
    from offload_core import Capability, get_backend

    if Capability.CHAOS in _info(backend_name).cls.capabilities:
        instance = get_backend(backend_name, chaos=True)  # a private instance: ours to close
        try:
            yield instance
        finally:
            instance.close()
    else:
        yield get_backend(backend_name)  # the process-wide shared instance: not ours to close


@pytest.fixture
def new_backend(backend_name: str) -> Iterator[Callable[..., Any]]:
    """Factory: ``new_backend(**options)`` builds a fresh instance of the selected backend.

    Chaos mode is added where the backend has it unless ``chaos`` is given. Every instance is
    closed at the end of the test.
    """
    from offload_core import Capability, get_backend

    cls = _info(backend_name).cls
    made: list[Any] = []

    def make(**options: Any) -> Any:
        if Capability.CHAOS in cls.capabilities:
            options.setdefault("chaos", True)
        instance = get_backend(backend_name, **options) if options else cls()
        made.append(instance)
        return instance

    try:
        yield make
    finally:
        for instance in made:
            instance.close()
