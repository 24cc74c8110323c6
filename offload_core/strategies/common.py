"""Pieces every strategy shares: the enable transaction, counters, and input placement."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch

from ..labels import Label, label

logger = logging.getLogger(__name__)


class Transaction:
    """Undo log for ``enable``: on failure, the steps done so far are undone in reverse, so the
    model is left exactly as it was (same tensors' values, dtypes, strides; no hooks)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def on_rollback(self, fn: Callable[[], None]) -> None:
        self._undo.append(fn)

    def __enter__(self) -> "Transaction":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None:
            for fn in reversed(self._undo):
                try:
                    fn()
                except Exception:  # noqa: BLE001 - keep undoing; the original error is what matters
                    logger.exception("rollback step failed while undoing a failed enable")
        self._undo.clear()
        return False


@dataclasses.dataclass
class Counters:
    """Transfer counters behind ``handle.stats()``."""

    h2d_bytes: int = 0
    h2d_copies: int = 0
    prefetch_misses: int = 0
    loads: int = 0

    def as_dict(self) -> dict[str, int]:
        return dataclasses.asdict(self)


def to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return type(obj)((k, to_device(v, device)) for k, v in obj.items())
    return obj


def inputs_to_device(device: torch.device) -> Callable:
    """A forward pre-hook (with kwargs) that moves a module's tensor inputs to ``device``."""

    def hook(module, args, kwargs):
        return to_device(args, device), to_device(kwargs, device)

    return hook


def copy_unit(unit, dst: dict[torch.dtype, torch.Tensor], backend, stream, counters: Counters) -> None:
    """Queue ``unit``'s host buffers into the per-dtype buffers ``dst``: one copy per dtype."""
    for dtype, src in unit.host.items():
        backend.copy_async(dst[dtype][: src.numel()], src, stream)
    counters.h2d_copies += len(unit.host)
    counters.h2d_bytes += unit.nbytes


def allocate_device(backend, numel: dict[torch.dtype, int], name: Label) -> dict[torch.dtype, torch.Tensor]:
    """One flat device buffer per dtype, named ``name`` in error reports (:mod:`offload_core.labels`)."""
    buffers = {dtype: backend.empty_device(n, dtype) for dtype, n in numel.items()}
    for buffer in buffers.values():
        label(buffer, name)
    return buffers


def pack_units(units, backend, pin_memory: bool, txn: Transaction, desc: str) -> None:
    """Pack each unit into its host home, one unit at a time, with a progress bar in bytes."""
    from tqdm.auto import tqdm

    if pin_memory:
        allocate = lambda n, dtype: backend.empty_pinned(n, dtype)  # noqa: E731
    else:
        allocate = lambda n, dtype: torch.empty(n, dtype=dtype)  # noqa: E731
    total = sum(u.nbytes for u in units)
    with torch.no_grad(), tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None, leave=False) as bar:
        for unit in units:
            unit.pack(allocate)
            for buffer in unit.host.values():
                label(buffer, f"host copy of {unit.name}")
            txn.on_rollback(unit.unpack)
            unit.keep_on(backend.device())
            bar.update(unit.nbytes)
    logger.info("%s: packed %d units, %.1f MB, into %s host memory", desc, len(units), total / 2**20,
                "pinned" if pin_memory else "pageable")

