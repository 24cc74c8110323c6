"""Distributed layerwise offloading: layerwise streaming across ranks with a fixed two-block
device buffer, and optionally each rank holding only 1/N of every block's host weights.

With ``shard_host_weights`` each block's per-dtype buffer is padded to a multiple of the world
size and split into N equal shards; rank r keeps shard r in pinned memory. Loading a block copies
this rank's shard into a small staging buffer, then an all-gather on the copy stream rebuilds the
whole block in the slot on every rank. Host memory per rank is then the resident part plus 1/N of
the blocks. Without sharding every rank keeps the whole model and the transport is a plain copy.

Every rank must run the same forwards in the same order (the all-gathers are collective), and
``disable`` is collective too: it rebuilds the full host weights on every rank.
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch import nn
from tqdm.auto import tqdm

from ..backend import DeviceBackend
from ..hostmem.placement import ONCE, STREAM, HostUnit, Tier
from ..weights import nbytes_of
from .common import Transaction, allocate_device, pack_units
from .layerwise import LayerwiseOffload

logger = logging.getLogger(__name__)


def _padded(n: int, world: int) -> int:
    return -(-n // world) * world


#: one copy stream per backend for every distributed part: collectives must run in the order they
#: were issued, which is the same on every rank, also when several DiTs stream (Wan2.2)
_COLLECTIVE_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _rebind_all(originals) -> None:
    for owner, tensor in originals:
        owner.rebind(tensor)


def _read_flat(source: torch.Tensor, start: int, count: int, out: torch.Tensor) -> None:
    """A pageable shard read into the bounce ring."""
    out.copy_(source[start : start + count])


class DistributedLayerwiseOffload(LayerwiseOffload):
    """Two slots, each the largest block padded to a multiple of the world size."""

    strategy = "distributed"

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[tuple[str, nn.Module]],
        backend: DeviceBackend,
        process_group: Any = None,
        shard_host_weights: bool = True,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "distributed layerwise offload needs an initialised torch.distributed process group "
                "(backend.init_process_group(rank, world_size, init_method) or torch.distributed.init_process_group)"
            )
        super().__init__(model, blocks, backend, prefetch_depth=1)
        self.group = process_group
        self.world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.shard = shard_host_weights and self.world > 1
        self.slot_shape = {dtype: _padded(n, self.world) for dtype, n in self.slot_shape.items()}
        self._shards: list[dict[torch.dtype, torch.Tensor]] = []

    @property
    def host_bytes(self) -> int:
        if not self.shard:
            return super().host_bytes
        return self.resident.nbytes + sum(self._shard_bytes(unit) for unit in self.units)

    @property
    def device_weight_bytes(self) -> int:
        staging = 2 * nbytes_of({d: n // self.world for d, n in self.slot_shape.items()}) if self.shard else 0
        return super().device_weight_bytes + staging

    def _host_buffers(self, i: int) -> dict:
        if self.shard:
            raise RuntimeError(
                "this rank holds only a shard of each block: a state dict needs the collective "
                "handle.disable() first, which rebuilds the full weights on every rank"
            )
        return super()._host_buffers(i)

    def _new_copy_stream(self):
        stream = _COLLECTIVE_STREAMS.get(self.backend)
        if stream is None:
            stream = _COLLECTIVE_STREAMS[self.backend] = self.backend.new_stream()
        return stream

    def _allocate_device(self) -> None:
        super()._allocate_device()
        if self.shard:
            self._staging = [
                allocate_device(
                    self.backend, {d: n // self.world for d, n in self.slot_shape.items()},
                    f"all-gather staging buffer {s} of {self._name}",
                )
                for s in range(self.num_slots)
            ]

    def host_units(self) -> list:
        if not self.shard:
            return super().host_units()
        return [HostUnit(self.resident, ONCE, self.resident.nbytes),
                *(HostUnit(u, STREAM, self._shard_bytes(u), self._shard_buffers(u)) for u in self.units)]

    def _shard_buffers(self, unit) -> tuple[int, ...]:
        return tuple(_padded(n, self.world) // self.world * dtype.itemsize for dtype, n in unit.numel.items())

    def _shard_bytes(self, unit) -> int:
        return sum(self._shard_buffers(unit))

    def _pack(self, txn: Transaction) -> None:
        """Keep only this rank's shard of each block, building one block's padded copy at a time.
        The owners keep their original tensors until enable binds them to the slots, and the undo
        log keeps them until enable succeeds, so a failure can put them back untouched."""
        if not self.shard:
            return super()._pack(txn)
        pack_units([self.resident], self.placement, txn, "resident weights")
        for unit in tqdm(self.units, desc=f"sharding blocks (rank {self.rank} of {self.world})", disable=None, leave=False):
            txn.on_rollback(functools.partial(_rebind_all, unit.originals()))
            self._shards.append(self._shard(unit))
            unit.keep_on(self.backend.device())

    def _shard(self, unit) -> dict[torch.dtype, torch.Tensor]:
        """This rank's shard of ``unit``, per dtype; the padded copy it is cut from dies on return."""
        full = unit.take(lambda n, dtype: torch.zeros(_padded(n, self.world), dtype=dtype))
        allocate = self.placement.allocator(unit)
        shards = {}
        for dtype, buffer in full.items():
            size = buffer.numel() // self.world
            shards[dtype] = allocate(size, dtype)
            shards[dtype].copy_(buffer[self.rank * size : (self.rank + 1) * size])
        return shards

    def _plan_transfers(self) -> None:
        if not self.shard:
            return super()._plan_transfers()
        self._transfers = []
        for i, (unit, shards) in enumerate(zip(self.units, self._shards)):
            slot, staging = self.slots[i % self.num_slots], self._staging[i % self.num_slots]
            direct = self.placement.tier(unit) in (Tier.PINNED, Tier.PAGEABLE)
            self._transfers.append([
                (staging[dtype][: shard.numel()], shard if direct else functools.partial(_read_flat, shard),
                 slot[dtype][: shard.numel() * self.world])
                for dtype, shard in shards.items()
            ])
        self._transfer_copies = [
            self.placement.copies([(staging, src) for staging, src, _ in transfers]) for transfers in self._transfers
        ]
        self._images = [None] * len(self.units)  # shards are never on disk
        self._transfer_bytes = [sum(s.numel() * s.element_size() for s in shards.values()) for shards in self._shards]

    def _issue(self, i: int, stream) -> None:
        if not self.shard:
            return super()._issue(i, stream)
        for staging, shard, out in self._transfers[i]:
            self.placement.issue([(staging, shard)], stream)
            self.backend.all_gather_into_tensor(out, staging, self.group, stream).wait(stream)

    def disable(self) -> None:
        """Collective: rebuild every block's full weights from the shards on every rank."""
        if not self.shard or not self._occupant:
            return super().disable()
        self._remove_hooks()
        host = self.backend.new_stream()
        for i, unit in enumerate(self.units):
            self._load(i)
            self._wait_ready(i, host)
            slot = self.slots[i % self.num_slots]
            unit.host = {dtype: torch.empty(n, dtype=dtype) for dtype, n in unit.numel.items()}
            for dtype, buf in unit.host.items():
                self.backend.copy_async(buf, slot[dtype][: buf.numel()], host)
            host.synchronize()
            self.freed[i % self.num_slots].record(host)
        super().disable()
        self._shards = []
