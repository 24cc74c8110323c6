"""The slot ring of a streamed model, and the load record of each streamed block.

A :class:`SlotRing` owns a few device slots (each as large as the largest streamed block, one
flat buffer per dtype), the event that says when each slot's last reader is done, and which block
each slot holds. Block ``i`` always goes through slot ``i % len(ring)`` (``slot_of``). Only the
ring reads its slots and writes its bookkeeping; the part, its transports and autograd ask it through
verbs (``claim``, ``release``, ``holds``, ``mark_free``, ``wait_free``, ``forget``; ``buffers_of``,
``buffer``, ``views_index`` for the slots' memory), so that the slot arithmetic lives in one place.

A slot is refilled only when nothing outside the ring references its memory: the ring counts the
uses of each slot's storages at rest (its own views: bindings, transfers, autograd's index) and,
before a refill, compares. A tensor that escaped its block (a kept ``detach()``, an output that
views a weight, a saved tensor) raises the count; the slot's memory is then left to its holder
and the slot gets new memory, so the holder keeps reading the weights it took.

A :class:`LoadRecord` is what the hot path needs of one block, built at enable and dropped at
disable, instead of parallel lists indexed by block.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Iterable

import torch

from ..base.errors import OffloadedModelError
from ..weights import nbytes_of
from ..weights.binding import Binding
from .common import allocate_device

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class LoadRecord:
    """What loading and binding block ``index`` takes."""

    index: int
    unit: Any  # its WeightUnit
    slot: int
    binding: Binding  # its tensors between their home views and its slot's views
    transfers: list  # what the transport issues to fill the slot (see transport.py)
    copies: int  # host-to-device copies per load, for the counters
    nbytes: int  # bytes per load, for the counters and the timeline
    image: Any  # its on-disk image when its home is on disk, else None
    write_back: Callable  # how a forward's changes to its tensors go home (see Binding.to_home)
    ready: Any  # event recorded once its transfers are queued
    ticket: Any = None  # the stager's ticket of a pending load


def slot_numel(units: Iterable[Any]) -> dict[torch.dtype, int]:
    """Per-dtype size of a slot that can hold any of ``units`` (its ``WeightUnit``s)."""
    need: dict[torch.dtype, int] = {}
    for unit in units:
        for dtype, n in unit.numel.items():
            need[dtype] = max(need.get(dtype, 0), n)
    return need


class SlotRing:
    """``count`` device slots of ``shape`` (numel per dtype), their free events and occupants."""

    def __init__(self, backend, shape: dict[torch.dtype, int], count: int, name: Callable[[int], Any]) -> None:
        self.backend = backend
        self.shape = shape
        self._name = name  # slot -> its label in error reports
        self._slots = [allocate_device(backend, shape, functools.partial(name, s)) for s in range(count)]
        self._freed = [backend.new_event() for _ in range(count)]
        self._occupant = [-1] * count
        # per slot: (its storages, kept alive, their addresses, their use counts at rest)
        self._uses: list[tuple[list, list[int], list[int]]] = [([], [], []) for _ in range(count)]

    def __len__(self) -> int:
        return len(self._slots)

    def __iter__(self):
        """Each slot's buffers (per dtype), in slot order."""
        return iter(self._slots)

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.shape)

    def slot_of(self, block: int) -> int:
        return block % len(self._slots)

    def blocks_of(self, slot: int, blocks: int) -> range:
        """Which of ``blocks`` blocks go through ``slot``."""
        return range(slot, blocks, len(self._slots))

    def buffers_of(self, block: int) -> dict[torch.dtype, torch.Tensor]:
        """The buffers (per dtype) of the slot block ``block`` goes through."""
        return self._slots[block % len(self._slots)]

    def buffers_at(self, slot: int) -> dict[torch.dtype, torch.Tensor]:
        return self._slots[slot]

    def buffer(self, slot: int, dtype: torch.dtype) -> torch.Tensor:
        return self._slots[slot][dtype]

    def views_index(self) -> dict[int, tuple[int, torch.dtype]]:
        """Which slot and dtype each slot buffer's storage is, by its address: how autograd tells a
        saved slot view (built again after a slot was renewed)."""
        return {
            buffer.untyped_storage().data_ptr(): (s, dtype)
            for s, buffers in enumerate(self._slots)
            for dtype, buffer in buffers.items()
            if buffer.numel()
        }

    def occupant(self, slot: int) -> int:
        """The block ``slot`` holds, -1 for none (also for a slot past the ring, which a label
        written while the ring is built may ask about)."""
        return self._occupant[slot] if slot < len(self._occupant) else -1

    @property
    def occupants(self) -> list[int]:
        """The block each slot holds (-1: none), a copy."""
        return list(self._occupant)

    def holds(self, block: int) -> bool:
        return self._occupant[block % len(self._slots)] == block

    def claim(self, slot: int, block: int) -> None:
        """``slot`` holds ``block`` from now (its load is queued)."""
        self._occupant[slot] = block

    def release(self, slot: int) -> None:
        """``slot`` holds no block (a load interrupted half-way leaves it empty, not stale)."""
        self._occupant[slot] = -1

    def forget(self) -> None:
        """No slot holds a block any more (they are refilled before use)."""
        self._occupant = [-1] * len(self._slots)

    def mark_free(self, slot: int, stream) -> None:
        """``slot`` may be refilled once ``stream``'s work issued so far is done."""
        self._freed[slot].record(stream)

    def wait_free(self, slot: int, stream) -> None:
        """``stream``'s next work (a copy into ``slot``) waits until the slot's last reader is done."""
        self._freed[slot].wait(stream)

    def free_all(self, stream) -> None:
        """Every slot may be refilled once ``stream``'s work issued so far is done."""
        for freed in self._freed:
            freed.record(stream)

    def settle(self, *slots: int) -> None:
        """Count the uses of ``slots`` (default: all) now, when only the ring's own views
        reference them."""
        for s in slots or range(len(self._slots)):
            self._uses[s] = _uses(self._slots[s])

    def at_rest(self, slot: int) -> bool:
        _, addresses, counts = self._uses[slot]
        return list(map(_use_count, addresses)) == counts

    def renew(self, slot: int, copy_stream, holding: str, owner: str) -> bool:
        """Before ``slot`` is refilled: True if its memory had to be left to a holder outside the
        ring and the slot now has new memory (the caller records the loads of this slot's blocks again)."""
        if self.at_rest(slot):
            return False
        copy_stream.synchronize()  # a finished transfer (a collective's work) may still hold views
        if self.at_rest(slot):
            return False
        try:
            replacement = allocate_device(self.backend, self.shape, functools.partial(self._name, slot))
        except torch.OutOfMemoryError as exc:
            raise OffloadedModelError(
                f"a tensor viewing the device weights of {holding} of {owner} is still referenced after its "
                "forward (a kept .detach() or view of a weight, or an output that views one), and there is no "
                f"device memory for a new slot ({exc}). Keep a .clone() instead of a view, or drop the reference "
                "before the next blocks run"
            ) from exc
        logger.warning(
            "%s: memory of slot %d (%s) is still referenced outside its block; it stays with its holder and the "
            "slot gets %.1f MB of new device memory", owner, slot, holding, self.nbytes / 2**20,
        )
        # the new memory may have been freed by compute still queued: copy into it after that
        self.backend.wait_stream(copy_stream, self.backend.current_stream())
        self._slots[slot] = replacement
        return True


#: how many tensors reference a storage (by its address, ``storage._cdata``)
_use_count = torch._C._storage_Use_Count


def _uses(slot: dict[torch.dtype, torch.Tensor]) -> tuple[list, list[int], list[int]]:
    storages = [b.untyped_storage() for b in slot.values() if b.numel()]
    addresses = [storage._cdata for storage in storages]
    return storages, addresses, list(map(_use_count, addresses))


def _alone() -> int:
    """The use count of a storage viewed by one tensor alone, counted as ``viewed`` counts."""
    alone = torch.empty(1)
    return _use_count(alone.untyped_storage()._cdata)


_ALONE = _alone()


def viewed(buffers: dict[torch.dtype, torch.Tensor]) -> bool:
    """Whether a tensor besides ``buffers`` themselves views their memory: one integer comparison
    per dtype, before looking for who (``kept_views``)."""
    return any(_use_count(b.untyped_storage()._cdata) > _ALONE for b in buffers.values() if b.numel())


def kept_views(model: torch.nn.Module, slot: dict[torch.dtype, torch.Tensor]) -> list[str]:
    """Where ``model`` keeps a tensor viewing ``slot``'s memory in a plain attribute (``self._wt =
    self.l1.weight.t()`` in a forward): "attribute _wt of module blocks.0", for the warning that
    names it when the slot has to be left to it."""
    addresses = {b.untyped_storage().data_ptr() for b in slot.values() if b.numel()}
    found = []
    for name, module in model.named_modules():
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() in addresses:
                found.append(f"attribute {attr} of module {name or type(model).__name__}")
    return found
