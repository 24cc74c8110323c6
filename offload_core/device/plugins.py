"""Backend registry: entry-point loading, listing and selection.

Selection order (docs/backends.md): an explicit name, then ``OFFLOAD_CORE_BACKEND``, then the available
backend of the highest tier and priority, where third-party accelerators outrank in-tree ones,
which outrank simulators.

Plugins are other people's code running inside every process that imports offload_core, so the
registry survives them: a plugin whose import, hook, ``probe()`` or ``unavailable_reason()`` fails
in any way (``SystemExit`` included; only ``KeyboardInterrupt`` passes) is reported and skipped, as
is a registration with a bad name, a name already taken, or a name of an in-tree backend (in-tree
plugins load first, so a plugin cannot replace them). A plugin that calls ``get_backend()`` while
it is being imported gets an error saying so, reported as its failure, instead of re-entering a
registry half built. Each backend is probed once per process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import inspect
import logging
import os
import re
import threading
from typing import Any

import pluggy

from ..base.errors import BackendNotFoundError, OffloadConfigError
from ..base.locks import locked
from . import hookspecs
from .backend import DeviceBackend

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "offload_core"
ENV_BACKEND = "OFFLOAD_CORE_BACKEND"
IN_TREE_DISTRIBUTION = "offload-core"
#: what a backend ``name`` may look like: it is typed on command lines and in environment variables
NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


@dataclasses.dataclass(frozen=True)
class BackendInfo:
    """One registered backend, as ``list_backends()`` and ``offload-core backends`` show it."""

    name: str
    cls: type[DeviceBackend]
    source: str  # the distribution that registered it, e.g. "offload-core" or "acme-offload"
    entry_point: str

    @property
    def priority(self) -> int:
        return self.cls.priority

    @property
    def in_tree(self) -> bool:
        return self.source == IN_TREE_DISTRIBUTION

    @functools.cached_property
    def available(self) -> bool:
        """``probe()``, asked once per process (a probe may cost a driver query)."""
        try:
            return bool(self.cls.probe())
        except KeyboardInterrupt:
            raise
        except BaseException:  # a probe that fails in any way means "not here"; say why once, in the log
            logger.warning("probe() of backend %r raised; treating it as unavailable", self.name, exc_info=True)
            return False

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot run here, in its own words, or None when it can."""
        return None if self.available else self._reason

    @functools.cached_property
    def _reason(self) -> str | None:
        try:
            reason = self.cls.unavailable_reason()
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - a diagnostic must not break a listing
            return f"unavailable_reason() raised {_describe(exc)}"
        return None if reason is None else str(reason)

    def rank(self) -> tuple[int, int]:
        """Auto-detection order: vendor accelerators > in-tree accelerators > simulators."""
        tier = 0 if not self.cls.is_accelerator else (1 if self.in_tree else 2)
        return tier, self.priority


@dataclasses.dataclass(frozen=True)
class PluginFailure:
    entry_point: str
    source: str
    error: str


class Registry:
    """Loads every ``offload_core`` entry point once (in-tree distributions first) and keeps the
    registered classes."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.backends: dict[str, BackendInfo] = {}
        self.failures: list[PluginFailure] = []
        self._instances: dict[str, DeviceBackend] = {}
        self._lock = threading.Lock()
        self._origin: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, entry point)
        entry_points = importlib.metadata.entry_points(group=ENTRY_POINT_GROUP)
        for ep in sorted(entry_points, key=lambda ep: _source(ep) != IN_TREE_DISTRIBUTION):
            self._load(ep)
        for impl in self.manager.hook.offload_core_register_backends.get_hookimpls():
            source, label = self._origin[impl.plugin_name]
            registered: list[type] = []
            try:
                impl.function(register=registered.append)
            except KeyboardInterrupt:
                raise
            except BaseException as exc:  # noqa: BLE001 - one broken plugin must not break the others
                self._fail(label, source, exc)
                continue
            for cls in registered:
                self._add(cls, source, label)

    def _load(self, ep: importlib.metadata.EntryPoint) -> None:
        source = _source(ep)
        label = f"{ep.name} = {ep.value}"
        if self.manager.has_plugin(ep.value):
            return  # the same module listed twice (e.g. an editable and a regular install)
        try:
            self.manager.register(ep.load(), name=ep.value)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - SystemExit too: one broken plugin must not break the others
            self._fail(label, source, exc)
            return
        self._origin[ep.value] = (source, label)

    def _fail(self, label: str, source: str, exc: BaseException | str) -> None:
        reason = exc if isinstance(exc, str) else _describe(exc)
        logger.warning("offload_core plugin %r from %s skipped: %s", label, source, reason)
        self.failures.append(PluginFailure(label, source, reason))

    def _add(self, cls: type, source: str, label: str) -> None:
        if not (isinstance(cls, type) and issubclass(cls, DeviceBackend)):
            return self._fail(label, source, f"registered {cls!r}, which is not a DeviceBackend subclass")
        if cls.__abstractmethods__:
            missing = ", ".join(sorted(cls.__abstractmethods__))
            return self._fail(label, source, f"{cls.__name__} does not implement {missing}")
        problem = _attribute_problem(cls)
        if problem:
            return self._fail(label, source, f"{cls.__name__} {problem}")
        existing = self.backends.get(cls.name)
        if existing is not None and existing.cls is not cls:
            if existing.in_tree and source != IN_TREE_DISTRIBUTION:
                return self._fail(
                    label, source, f"backend name {cls.name!r} is the in-tree backend's; a plugin cannot replace it"
                )
            return self._fail(label, source, f"backend name {cls.name!r} is already registered by {existing.source}")
        self.backends[cls.name] = BackendInfo(cls.name, cls, source, label)

    # -- selection ----------------------------------------------------------------------------
    def info(self, name: str) -> BackendInfo:
        try:
            return self.backends[name]
        except KeyError:
            known = ", ".join(sorted(self.backends)) or "none"
            raise BackendNotFoundError(f"unknown offload backend {name!r}; registered backends: {known}") from None

    def auto(self) -> tuple[BackendInfo, str]:
        """The backend auto-detection picks, and a sentence saying why."""
        available = [b for b in self.backends.values() if b.available]
        if not available:
            known = ", ".join(sorted(self.backends)) or "none"
            raise BackendNotFoundError(f"no offload backend is available here; registered backends: {known}")
        best = max(available, key=BackendInfo.rank)
        if not best.cls.is_accelerator:
            return best, f"no accelerator backend is available; falling back to the simulator {best.name!r}"
        kind = "in-tree" if best.in_tree else f"third-party ({best.source})"
        return best, f"highest-ranked available backend: {kind} accelerator, priority {best.priority}"

    def resolve(self, name: str | None) -> tuple[BackendInfo, str]:
        if name is not None:
            return self.info(name), "named explicitly"
        env = os.environ.get(ENV_BACKEND)
        if env:
            return self.info(env), f"named by {ENV_BACKEND}"
        return self.auto()

    def get(self, name: str | None, options: dict[str, Any]) -> DeviceBackend:
        info, why = self.resolve(name)
        if name is None and not info.cls.is_accelerator:
            logger.warning("%s", why)
        else:
            logger.debug("offload backend %r selected: %s", info.name, why)
        if options:
            _check_options(info, options)
            return info.cls(**options)
        return locked(self._lock, self._shared, info)

    def _shared(self, info: BackendInfo) -> DeviceBackend:
        """The one instance of ``info``'s backend without options (the caller holds the lock)."""
        instance = self._instances.get(info.name)
        if instance is None:
            instance = self._instances[info.name] = info.cls()
        return instance


def _source(ep: importlib.metadata.EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "?"


def _attribute_problem(cls: type[DeviceBackend]) -> str | None:
    """What is wrong with the class attributes selection reads, or None."""
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name):
        return f"has an invalid name {name!r} (letters, digits, '_', '.', '-'; not empty)"
    priority = getattr(cls, "priority", None)
    if isinstance(priority, bool) or not isinstance(priority, int):
        return f"has a priority that is not an integer: {priority!r}"
    if not isinstance(getattr(cls, "is_accelerator", None), bool):
        return f"has is_accelerator that is not True or False: {getattr(cls, 'is_accelerator', None)!r}"
    return None


def _check_options(info: BackendInfo, options: dict[str, Any]) -> None:
    """Options the backend's constructor does not take are an error naming them and the valid ones."""
    params = inspect.signature(info.cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = [n for n, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = [name for name in options if name not in valid]
    if unknown:
        raise OffloadConfigError(
            f"backend {info.name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options: {', '.join(valid) or 'none'}"
        )


_REGISTRY: Registry | None = None
_REGISTRY_LOCK = threading.RLock()
_BUILDING = False


def registry() -> Registry:
    """The process's registry, built on first use. Threads wait for one another; a call from the
    thread that is building it (a plugin using offload_core while it is imported) is an error."""
    if _REGISTRY is not None:
        return _REGISTRY
    return locked(_REGISTRY_LOCK, _build_registry)


def _build_registry() -> Registry:
    """The registry, built once (the caller holds ``_REGISTRY_LOCK``)."""
    global _REGISTRY, _BUILDING
    if _REGISTRY is None:
        if _BUILDING:
            raise RuntimeError(
                "offload_core's backend registry was used while its plugins were being loaded (a plugin "
                "called get_backend() or list_backends() at import time); use it later, e.g. inside the "
                "backend's methods"
            )
        _BUILDING = True
        try:
            _REGISTRY = Registry()
        finally:
            _BUILDING = False
    return _REGISTRY


def get_backend(name: str | DeviceBackend | None = None, **options: Any) -> DeviceBackend:
    """The backend to use.

    ``name`` may be a registered name, a :class:`DeviceBackend` instance (returned as is), or
    None: then ``OFFLOAD_CORE_BACKEND``, else auto-detection. Without options every call returns
    one shared instance per name; with options, a new instance configured by them.
    """
    if isinstance(name, DeviceBackend):
        if options:
            raise TypeError("options cannot be applied to an already constructed backend instance")
        return name
    return registry().get(name, options)


def list_backends() -> list[BackendInfo]:
    """Every registered backend, in auto-detection order (best first)."""
    return sorted(registry().backends.values(), key=lambda b: (b.rank(), b.name), reverse=True)
