"""Pieces every strategy shares: counters, input placement, packing and device buffers."""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import torch

from ..common.config import OffloadConfig
from ..hostmem.machine import Trimmer
from ..hostmem.placement import Tier, place_homes
from ..common.labels import Label, label
from ..common.transaction import Transaction

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Counters:
    """Transfer counters behind ``handle.stats()``."""

    h2d_bytes: int = 0
    h2d_copies: int = 0
    prefetch_misses: int = 0
    loads: int = 0
    retired_slot_bytes: int = 0  # device memory of slots left to tensors that still view them
    switch_h2d_bytes: int = 0  # of h2d_bytes: parked weights loaded back as their phase began

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


def copy_unit(unit, dst: dict[torch.dtype, torch.Tensor], placement, stream, counters: Counters):
    """Queue ``unit``'s home into the per-dtype buffers ``dst`` on ``stream``: one copy per dtype
    (one per bounce chunk for a home outside pinned memory). Returns the load's ticket (see
    ``Placement.run``), None when it was issued at once."""
    transfers = placement.transfers(unit, dst)
    counters.h2d_copies += placement.copies(transfers)
    counters.h2d_bytes += unit.nbytes
    return placement.run(functools.partial(_issue, placement, transfers, stream))


def _issue(placement, transfers, stream) -> None:
    with placement.backend.batch(stream):  # one stream context for every dtype of the unit
        placement.issue(transfers, stream)


@torch.inference_mode(False)  # a load inside the user's inference_mode: later copies write them outside it
def allocate_device(backend, numel: dict[torch.dtype, int], name: Label) -> dict[torch.dtype, torch.Tensor]:
    """One flat device buffer per dtype, named ``name`` in error reports
    (:mod:`offload_core.common.labels`)."""
    buffers = {dtype: backend.empty_device(n, dtype) for dtype, n in numel.items()}
    for buffer in buffers.values():
        label(buffer, name)
    return buffers


def device_copy(backend, tensor: torch.Tensor, name: Label) -> torch.Tensor:
    """A copy of ``tensor`` in new device memory, named ``name`` in error reports, issued on the
    compute stream: same shape and dtype, and the same strides for a dense layout (others are
    made contiguous, as ``torch.empty_like`` makes them)."""
    stride = torch.empty_like(tensor, device="meta").stride()
    copy = backend.empty_device(tensor.numel(), tensor.dtype).as_strided(tensor.shape, stride)
    label(copy, name)
    backend.copy_async(copy, tensor, backend.current_stream())
    return copy


def default_placement(part, txn: Transaction) -> None:
    """A part enabled on its own, not through ``enable_offload``, gets the default placement
    (every home pinned within the default budget)."""
    if part.placement is None:
        place_homes([part], OffloadConfig(), part.backend).attach([part], txn)


def pack_units(units, placement, txn: Transaction, desc: str) -> None:
    """Give each unit its host home, one unit at a time, with a progress bar in bytes: packed into
    pinned or pageable memory, or (tier ``disk``) left on disk, spilled there first when the
    model is in RAM. Units read from a checkpoint are loaded straight into their home."""
    from tqdm.auto import tqdm

    total = sum(u.nbytes for u in units)
    trimmer = Trimmer()
    with torch.no_grad(), tqdm(total=total, desc=desc, unit="B", unit_scale=True, disable=None, leave=False) as bar:
        for unit in units:
            if placement.tier(unit) is Tier.DISK:
                bar.set_description(f"spilling {desc}" if not unit.from_checkpoint else f"indexing {desc}")
                placement.spill(unit)
            else:
                bar.set_description(f"loading {desc}" if unit.from_checkpoint else f"packing {desc}")
                unit.pack(placement.allocator(unit))
                for buffer in unit.host.values():
                    label(buffer, f"host copy of {unit.name}")
            txn.on_rollback(unit.unpack)
            unit.keep_on(placement.backend.device())
            bar.update(unit.nbytes)
            trimmer.add(unit.nbytes)
    trimmer.flush()
    logger.info("%s: %d units, %.1f MB, placed: %s", desc, len(units), total / 2**20, placement.summary())


def unpack_units(units, placement) -> None:
    """Give every unit's tensors ordinary host memory again, one unit at a time, releasing each
    home as soon as its unit is unpacked (pinned slabs included, see ``Placement.unpack``): host
    memory stays near one copy of the model. An item is a unit, or ``(unit, views)`` for a unit
    whose owners show views other than its home (see ``WeightUnit.unpack``)."""
    trimmer = Trimmer()
    for item in units:
        unit, bound = item if isinstance(item, tuple) else (item, None)
        if unit.host or unit.image is not None or unit.kept:
            placement.unpack(unit, bound)
            trimmer.add(unit.nbytes)
    trimmer.flush()

