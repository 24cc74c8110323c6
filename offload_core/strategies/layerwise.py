"""Layerwise offloading: blocks stream through a fixed ring of device slots.

Each block is bound once, at enable, to views of slot ``i % slots``, so the steady-state forward
does no per-parameter work: before block ``i`` runs, a wrapper around its call marks the slot
of the block that ran before it free (an event on the compute stream: all of that block's compute
has been issued by now), makes sure ``i`` is the occupant of its slot (else loads it synchronously
and counts a miss), queues the prefetch of the next ``prefetch_depth`` blocks, and makes the
compute stream wait for ``i``'s ready event. A copy into a slot always waits for the slot's free
event, so a slot is never overwritten while a block reads it. The ring wraps, so the end of one
forward prefetches the start of the next.

A model with one block gets one slot: nothing can be copied while the block computes, so the
copy cannot overlap (the enable log says so). The block stays in its slot between forwards, and a
reload (a miss) waits for the slot's free event, recorded when the block's last forward ended.

Blocks whose home is not pinned (a ``pinned_memory`` budget, or on disk with ``host_memory``) are
loaded by the placement's stager thread through its bounce ring: ``_load`` then hands the whole
load (slot wait, copies, ready event) to the stager, and the block's ticket is waited before
compute waits on its ready event.
"""

from __future__ import annotations

import functools
import logging
import warnings
import weakref
from typing import Sequence

import torch
from torch import nn

from ..backend import DeviceBackend
from ..hostmem.placement import ONCE, STREAM, HostUnit
from ..timeline import UNTRACED
from ..weights import nbytes_of, slot_numel, split_units
from .calls import CallWrapper
from .common import (
    Counters,
    Transaction,
    allocate_device,
    copy_unit,
    default_placement,
    pack_units,
    unpack_units,
)

logger = logging.getLogger(__name__)


class LayerwiseOffload:
    """Streams the blocks of one model; everything outside the blocks stays resident."""

    strategy = "layerwise"
    #: set while ``handle.trace()`` records; spans are named "<label>.<block name>", the label being
    #: the model's class name, or its component name in a pipeline
    timeline = None

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[tuple[str, nn.Module]],
        backend: DeviceBackend,
        prefetch_depth: int = 1,
    ) -> None:
        if not blocks:
            raise ValueError(f"layerwise offload of {type(model).__name__} needs a block to stream, found none")
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        self.model = model
        self.label = type(model).__name__
        self.block_names = [name for name, _ in blocks]
        self.blocks = [block for _, block in blocks]
        self.backend = backend
        self.depth = min(prefetch_depth, len(blocks) - 1)
        self.counters = Counters()
        self.resident, self.units = split_units(model, blocks)
        self.num_slots = self.depth + 1
        self.slot_shape = slot_numel(self.units)
        self._hooks: list = []
        self._occupant: list[int] = []
        self._tickets: dict[int, object] = {}  # block -> stager ticket of its pending load
        self.placement = None  # set by the enabling code (plan_placement) before enable

    def host_units(self) -> list:
        """The units whose homes the placement policy decides: blocks are streamed every step."""
        return [HostUnit(self.resident, ONCE, self.resident.nbytes),
                *(HostUnit(u, STREAM, u.nbytes) for u in self.units)]

    # -- sizes ----------------------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        return self.resident.nbytes

    @property
    def slot_bytes(self) -> int:
        return nbytes_of(self.slot_shape)

    @property
    def device_weight_bytes(self) -> int:
        """Device bytes this strategy holds: resident + slots x largest block (per dtype)."""
        return self.resident_bytes + self.num_slots * self.slot_bytes

    @property
    def host_bytes(self) -> int:
        return self.resident.nbytes + sum(u.nbytes for u in self.units)

    # -- lifecycle ------------------------------------------------------------------------
    def enable(self, txn: Transaction) -> None:
        backend = self.backend
        default_placement(self, txn)
        self._allocate_device()
        resident_device = allocate_device(backend, self.resident.numel, f"resident weights of {self._name}")
        txn.on_rollback(self._release)
        self._pack(txn)
        self.copy_stream = self._new_copy_stream()
        # The new buffers may reuse memory that compute issued earlier still reads (a caching
        # allocator hands freed blocks to the next allocation at once): copy after that compute.
        backend.wait_stream(self.copy_stream, backend.current_stream())
        self.ready = [backend.new_event() for _ in self.units]
        self.freed = [backend.new_event() for _ in range(self.num_slots)]
        self._occupant = [-1] * self.num_slots
        self._running = -1  # the block whose slot is not yet marked free
        self._deferred = False
        self._warned_grad = False
        self._stager = self.placement.stager
        self.placement.wait(copy_unit(self.resident, resident_device, self.placement, self.copy_stream, self.counters))
        done = backend.new_event()
        done.record(self.copy_stream)
        done.synchronize()
        self.resident.bind(resident_device)
        txn.on_rollback(lambda: self.resident.bind(self.resident.host))
        self._plan_transfers()
        for i, unit in enumerate(self.units):
            unit.bind(self.slots[i % self.num_slots])
            if unit.host:
                txn.on_rollback(functools.partial(unit.bind, unit.host))
        # One wrapper per block: a block's slot is marked free when the next block (or the end of
        # the model's call) starts, since all of its compute has been issued by then.
        for i, block in enumerate(self.blocks):
            self._hooks.append(CallWrapper(block, functools.partial(self._before_block, i)))
            pre, post = self._state_dict_hooks(i)
            self._hooks.append(block.register_state_dict_pre_hook(pre))
            self._hooks.append(block.register_state_dict_post_hook(post))
        self._hooks.append(CallWrapper(self.model, after=self._after_model, device=backend.device()))
        txn.on_rollback(self._remove_hooks)
        for i in range(self.num_slots):
            self._load(i)
        # undone first: a later failure must not free slots and host buffers under queued copies
        txn.on_rollback(self._settle)
        logger.info(
            "%s offload of %s: %d blocks, %d slots of %.1f MB, %.1f MB resident%s",
            self.strategy, type(self.model).__name__, len(self.units), self.num_slots, self.slot_bytes / 2**20,
            self.resident_bytes / 2**20,
            "; one block in one slot: its copy cannot overlap compute" if len(self.units) == 1 else "",
        )

    def _state_dict_hooks(self, i: int):
        """A block's tensors view a shared slot between forwards; its state dict must come from
        the host copy, the truth, so that saving an offloaded model saves the right weights. The
        block is bound to its host buffers while its state dict is taken, so that modules with
        their own ``_save_to_state_dict`` (optimum-quanto's) read the truth too."""
        unit = self.units[i]

        def pre(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            unit.bind(self._host_buffers(i))

        def post(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
            unit.bind(self.slots[i % self.num_slots])

        return pre, post

    def _host_buffers(self, i: int) -> dict:
        return self.units[i].home()

    def _new_copy_stream(self):
        return self.backend.new_stream()

    def _allocate_device(self) -> None:
        # the label holds the strategy weakly: a global label table must not keep a model alive
        self.slots = [
            allocate_device(self.backend, self.slot_shape, functools.partial(_slot_label, weakref.ref(self), s))
            for s in range(self.num_slots)
        ]

    @property
    def _name(self) -> str:
        return f"{self.strategy} {type(self.model).__name__}"

    def _pack(self, txn: Transaction) -> None:
        """Give every unit its host home (here: the whole unit, one buffer per dtype)."""
        pack_units([self.resident, *self.units], self.placement, txn, type(self.model).__name__)

    def _plan_transfers(self) -> None:
        """(slot view, source) per dtype, per block: the hot path only issues copies. A source is a
        host buffer copied straight, or a reader staged through the bounce ring."""
        self._transfers = [
            self.placement.transfers(unit, self.slots[i % self.num_slots]) for i, unit in enumerate(self.units)
        ]
        self._transfer_copies = [self.placement.copies(t) for t in self._transfers]
        self._transfer_bytes = [unit.nbytes for unit in self.units]
        self._images = [unit.image for unit in self.units]

    def _issue(self, i: int, stream) -> None:
        """Queue on ``stream`` the transfers that fill block ``i``'s slot."""
        if self._stager is None:  # every source is a host buffer: the hot path, plain copies
            for dst, src in self._transfers[i]:
                self.backend.copy_async(dst, src, stream)
        else:
            self.placement.issue(self._transfers[i], stream)

    def disable(self) -> None:
        """Wait for queued copies, give every tensor back an ordinary host copy, free the device.
        Each unit's home is released as soon as it is unpacked (the transfer plan, which also
        references the homes, goes first), so host memory stays near one copy of the model."""
        self._remove_hooks()
        if self._occupant:
            self._settle()
        self._transfers = self._images = []
        unpack_units([self.resident, *self.units], self.placement)
        self._release()

    def _settle(self) -> None:
        """Let every queued load finish: their copies read the homes that a rollback frees."""
        self.placement.drain()
        self.copy_stream.synchronize()

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def _release(self) -> None:
        self.slots = []
        self._transfers = self._images = []
        self._occupant = []
        self._tickets = {}

    # -- streaming ------------------------------------------------------------------------
    def _load(self, i: int) -> None:
        """Queue block ``i``'s transfers into its slot once the slot's last reader is done."""
        slot = i % self.num_slots
        self._occupant[slot] = i
        if self._stager is None:
            self._queue_load(i, slot)
        else:
            image = self._images[i]
            if image is not None:  # on disk: the kernel reads ahead while earlier loads are staged
                image.advise()
            # The stager waits on freed[slot] later: safe, because freed[slot] is recorded again
            # only after block i has run, and block i runs only after this load's ticket.
            self._tickets[i] = self._stager.submit(functools.partial(self._queue_load, i, slot))
        counters = self.counters
        counters.loads += 1
        counters.h2d_copies += self._transfer_copies[i]
        counters.h2d_bytes += self._transfer_bytes[i]

    def _queue_load(self, i: int, slot: int) -> None:
        stream = self.copy_stream
        self.freed[slot].wait(stream)
        if self.timeline is None:
            self._issue(i, stream)
        else:
            issue = functools.partial(self._issue, i, stream)
            self.timeline.copy(stream, self._span_name(i), self._transfer_bytes[i], issue)
        self.ready[i].record(stream)

    def _prefetch(self, i: int, running: bool) -> None:
        """Queue the next ``depth`` blocks after ``i`` whose slot holds no block still needed first.
        A prefetch into the slot of the running block ``i`` (odd rings wrap onto it) is deferred
        until ``i`` has finished."""
        n = len(self.units)
        for k in range(1, self.depth + 1):
            j = (i + k) % n
            occupant = self._occupant[j % self.num_slots]
            if occupant == j:
                continue
            ahead = (occupant - i) % n if occupant >= 0 else n
            if ahead == 0 and running:
                self._deferred = True
                continue
            if 0 < ahead < k:
                continue  # the occupant runs before j: a later hook queues j
            self._load(j)

    def _wait_ready(self, i: int, reader=None) -> None:
        """Make compute (a trace records the wait), or the stream ``reader``, wait until block
        ``i`` is in its slot."""
        if self._tickets:
            self.placement.wait(self._tickets.pop(i, None))
        if reader is not None:  # not compute: the distributed read-back at disable
            self.ready[i].wait(reader)
            return
        stream = self.backend.current_stream()
        with UNTRACED if self.timeline is None else self.timeline.compute_after(stream, self._span_name(i)):
            self.ready[i].wait(stream)

    def _span_name(self, i: int) -> str:
        return f"{self.label}.{self.block_names[i]}"

    def _finish_running(self) -> None:
        """Mark the slot of the block that ran last as free: its compute has all been issued."""
        last = self._running
        if last < 0:
            return
        self._running = -1
        self.freed[last % self.num_slots].record(self.backend.current_stream())
        if self.timeline is not None:
            self.timeline.end_compute(self.backend.current_stream())
        if self._deferred:
            self._deferred = False
            self._prefetch(last, running=False)

    def _before_block(self, i: int) -> None:
        self._finish_running()
        if self._occupant[i % self.num_slots] != i:
            self.counters.prefetch_misses += 1
            logger.debug("block %s called out of order: loading it synchronously", self.block_names[i])
            if self.timeline is not None:
                self.timeline.prefetch_miss(self._span_name(i))
            self._load(i)
        self._prefetch(i, running=True)
        self._wait_ready(i)
        self._running = i

    def _after_model(self) -> None:
        self._finish_running()
        if not self._warned_grad and torch.is_grad_enabled() and any(p.requires_grad for p in self.blocks[0].parameters()):
            self._warned_grad = True
            warnings.warn(
                f"{type(self.model).__name__} ran with autograd enabled while its blocks stream through shared "
                "device slots: the forward is exact, but a backward pass would read overwritten weights. "
                "Run offloaded models under torch.no_grad() or torch.inference_mode().",
                UserWarning,
                stacklevel=2,
            )


def _slot_label(strategy: "weakref.ref[LayerwiseOffload]", slot: int) -> str:
    """What a slot holds, for error reports: evaluated only when a report is written."""
    self = strategy()
    if self is None:
        return f"slot {slot} of a layerwise offload that was disabled"
    occupant = self._occupant[slot] if slot < len(self._occupant) else -1
    holding = f"block {self.block_names[occupant]}" if occupant >= 0 else "no block yet"
    return f"slot {slot} of {self._name} ({holding})"
