"""Backend registry: entry-point loading, listing and selection.

Selection order (docs/backends.md): an explicit name, then ``OFFLOAD_CORE_BACKEND``, then the available
backend of the highest tier and priority, where third-party accelerators outrank in-tree ones,
which outrank simulators. A plugin that fails to import is logged and skipped.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.metadata
import logging
import os
import threading
from typing import Any

import pluggy

from . import hookspecs
from .backend import DeviceBackend

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "offload_core"
ENV_BACKEND = "OFFLOAD_CORE_BACKEND"
IN_TREE_DISTRIBUTION = "offload-core"


class BackendNotFoundError(LookupError):
    """Raised for a backend name that no plugin registered."""


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

    @property
    def available(self) -> bool:
        try:
            return bool(self.cls.probe())
        except Exception:  # a probe that raises means "not here"; say why once, in the log
            logger.warning("probe() of backend %r raised; treating it as unavailable", self.name, exc_info=True)
            return False

    def unavailable_reason(self) -> str | None:
        """Why the backend cannot run here, in its own words, or None when it can."""
        if self.available:
            return None
        try:
            return self.cls.unavailable_reason()
        except Exception as exc:  # noqa: BLE001 - a diagnostic must not break a listing
            return f"unavailable_reason() raised {type(exc).__name__}: {exc}"

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
    """Loads every ``offload_core`` entry point once and keeps the registered classes."""

    def __init__(self) -> None:
        self.manager = pluggy.PluginManager(hookspecs.PROJECT)
        self.manager.add_hookspecs(hookspecs)
        self.backends: dict[str, BackendInfo] = {}
        self.failures: list[PluginFailure] = []
        self._instances: dict[str, DeviceBackend] = {}
        self._lock = threading.Lock()
        self._origin: dict[str, tuple[str, str]] = {}  # plugin name -> (distribution, entry point)
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            self._load(ep)
        for impl in self.manager.hook.offload_core_register_backends.get_hookimpls():
            source, label = self._origin[impl.plugin_name]
            registered: list[type] = []
            try:
                impl.function(register=registered.append)
            except Exception as exc:  # noqa: BLE001 - one broken plugin must not break the others
                self._fail(label, source, exc)
                continue
            for cls in registered:
                self._add(cls, source, label)

    def _load(self, ep: importlib.metadata.EntryPoint) -> None:
        source = ep.dist.name if ep.dist is not None else "?"
        label = f"{ep.name} = {ep.value}"
        if self.manager.has_plugin(ep.value):
            return  # the same module listed twice (e.g. an editable and a regular install)
        try:
            self.manager.register(ep.load(), name=ep.value)
        except Exception as exc:  # noqa: BLE001 - one broken plugin must not break the others
            self._fail(label, source, exc)
            return
        self._origin[ep.value] = (source, label)

    def _fail(self, label: str, source: str, exc: Exception | str) -> None:
        reason = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
        logger.warning("offload_core plugin %r from %s skipped: %s", label, source, reason)
        self.failures.append(PluginFailure(label, source, reason))

    def _add(self, cls: type, source: str, label: str) -> None:
        if not (isinstance(cls, type) and issubclass(cls, DeviceBackend)):
            return self._fail(label, source, f"registered {cls!r}, which is not a DeviceBackend subclass")
        if cls.__abstractmethods__:
            missing = ", ".join(sorted(cls.__abstractmethods__))
            return self._fail(label, source, f"{cls.__name__} does not implement {missing}")
        existing = self.backends.get(cls.name)
        if existing is not None and existing.cls is not cls:
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
            return info.cls(**options)
        with self._lock:
            instance = self._instances.get(info.name)
            if instance is None:
                instance = self._instances[info.name] = info.cls()
            return instance


@functools.lru_cache(maxsize=1)
def registry() -> Registry:
    return Registry()


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
