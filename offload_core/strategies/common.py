"""Pieces every strategy shares: the enable transaction, counters, and input placement."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import torch
from torch import nn

from ..labels import Label, label
from ..weights.slabs import SlabAllocator

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


def pack_units(units, backend, pin_memory: bool, txn: Transaction, desc: str,
               slabs: SlabAllocator | None = None) -> SlabAllocator | None:
    """Pack each unit into its host home, one unit at a time, with a progress bar in bytes.

    Pinned homes are views into slabs (``slabs``, else an allocator planned for ``units``; see
    :mod:`offload_core.weights.slabs`), returned so that the part can report its real pinned bytes.
    """
    from tqdm.auto import tqdm

    if pin_memory:
        slabs = slabs or SlabAllocator.for_units(backend, units)
        allocate = slabs.allocate
        txn.on_rollback(backend.empty_host_cache)  # undone last: after every slab has died
    else:
        slabs = None
        allocate = lambda n, dtype: torch.empty(n, dtype=dtype)  # noqa: E731
    total = sum(u.nbytes for u in units)
    with torch.no_grad(), tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None, leave=False) as bar:
        for unit in units:
            unit.pack(allocate)
            for buffer in unit.host.values():
                label(buffer, f"host copy of {unit.name}")
            txn.on_rollback(unit.unpack)
            bar.update(unit.nbytes)
    logger.info("%s: packed %d units, %.1f MB, into %s host memory", desc, len(units), total / 2**20,
                "pinned" if pin_memory else "pageable")
    return slabs


def unpack_units(units, backend, slabs: SlabAllocator | None) -> None:
    """Give every packed unit ordinary host tensors again. A slab dies with its last unit; the
    host allocator's cache is emptied then, so pinned memory goes back as disable proceeds."""
    for unit in units:
        if not unit.host:
            continue
        before = slabs.live_slabs if slabs is not None else 0
        unit.unpack()
        if slabs is not None and slabs.live_slabs < before:
            backend.empty_host_cache()


def pinned_bytes(slabs: SlabAllocator | None) -> int:
    """Real pinned bytes (the backend's rounding included) of a part's slabs still alive."""
    return slabs.live_bytes if slabs is not None else 0


class ForwardWrapper:
    """Runs ``before()`` ahead of ``module``'s forward, by shadowing ``forward`` with an instance
    attribute. Cheaper than a forward pre-hook, which sends every call of the module down torch's
    slow hook path; this runs once per block per step. ``remove()`` restores what was there."""

    def __init__(self, module: nn.Module, before: Callable[[], None]) -> None:
        self.module = module
        self._shadowed = module.__dict__.get("forward")  # e.g. another library's wrapper
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            before()
            return inner(*args, **kwargs)

        module.forward = forward

    def remove(self) -> None:
        if self._shadowed is not None:
            self.module.forward = self._shadowed
        else:
            self.module.__dict__.pop("forward", None)
