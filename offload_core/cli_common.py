"""What every subcommand module shares: the one error type and the backend check."""

from __future__ import annotations

from . import plugins


class UsageError(Exception):
    """Bad input: reported as ``offload-core: error: <message>`` with exit status 2."""


def available_backend(name: str | None) -> plugins.BackendInfo:
    """The backend ``name`` (None: the one selection picks), or a UsageError saying why it cannot
    be used here; checked before any model is built or process started."""
    registry = plugins.registry()
    try:
        info = registry.info(name) if name is not None else registry.resolve(None)[0]
    except plugins.BackendNotFoundError as exc:
        raise UsageError(str(exc)) from None
    reason = info.unavailable_reason()
    if not info.available:
        raise UsageError(f"backend {info.name!r} is registered but not available here" + (f": {reason}" if reason else ""))
    return info
