"""What every subcommand module shares: the one error type, the backend check, table layout."""

from __future__ import annotations

from typing import Sequence

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


def columns(rows: Sequence[Sequence[str]]) -> list[str]:
    """``rows`` (the header first, if any) as lines of left-aligned columns two spaces apart."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
