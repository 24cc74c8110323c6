"""Layerwise offloading: blocks stream through a fixed ring of device slots.

A block's tensors show its device slot only while the block's own forward runs; before and
after, they show the block's host buffer, the truth. So whatever the user does between forwards
(``load_state_dict``, in-place edits, LoRA fusing, reading a weight, calling a child module from
elsewhere) reads and writes the truth, and a copy never computes on another block's weights.

The part has three pieces: the slot ring (ring.py: slots, their free events and occupants, the
check that nothing outside the ring still holds a slot), one :class:`BlockPlan` per streamed block
(its binding, transfers and ready event), and a transport (transport.py: a plain copy of the
block's home; gather.py: a rank's shard plus an all-gather) that fills a slot. This module is the
protocol that ties them together.

Blocks kept resident (``resident_blocks``, partial residency) are part of the resident weights:
on the device for the whole time, like the model's non-block weights. Streamed blocks between
them copy while they compute; the first kept block reached starts the pass like a streamed one.

A model with one streamed block gets one slot: nothing can be copied while the block computes, so
its copy at the start of each forward cannot overlap (the enable log says so).
"""

from __future__ import annotations

import functools
import logging
import weakref
from typing import Sequence

import torch
from torch import nn

from ..backend import DeviceBackend
from ..errors import OffloadedModelError
from ..hostmem.disk import check_placeholders
from ..transaction import Transaction
from ..weights import nbytes_of, split_units
from ..weights.binding import Binding, Homes
from .autograd import SavedSlots
from .common import allocate_device, copy_unit, default_placement, unpack_units
from .part import Part, adopt_foreign, blocks_now, write_back
from .ring import BlockPlan, SlotRing, slot_numel
from .streaming import Streaming
from .transport import CopyTransport

logger = logging.getLogger(__name__)


class LayerwiseOffload(Streaming, Part):
    """Streams the blocks of one model; everything outside the streamed blocks stays resident.
    The pass and block protocol is :class:`Streaming`'s (streaming.py)."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[tuple[str, nn.Module]],
        backend: DeviceBackend,
        prefetch_depth: int = 1,
        transport: CopyTransport | None = None,
        resident_blocks: Sequence[int] = (),
    ) -> None:
        if not blocks:
            raise ValueError(f"layerwise offload of {type(model).__name__} needs a block to stream, found none")
        if prefetch_depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {prefetch_depth}")
        kept = set(resident_blocks)
        if not kept <= set(range(len(blocks))) or len(kept) == len(blocks):
            raise ValueError(
                f"resident_blocks of {type(model).__name__} must be indices of some of its {len(blocks)} blocks, "
                f"leaving one to stream; got {sorted(resident_blocks)}"
            )
        super().__init__(backend)
        self.model = model
        self.transport = transport or CopyTransport()
        self.transport.serve(self)
        self.strategy = self.transport.strategy
        self.label = type(model).__name__  # names timeline spans: "<label>.<block name>"
        self.kept_names = [name for k, (name, _) in enumerate(blocks) if k in kept]
        self.prefetch_depth = prefetch_depth
        self._passes = 0  # nesting depth of model forwards
        self._starting = False  # a pass began and its first block has not been reached yet
        self._frozen = 0  # inside handle.frozen(): the next pass's first blocks load as a pass ends
        self._preloaded: list[tuple[int, tuple[int, ...]]] = []  # (block, its versions) loaded as a pass ended
        self._bound = -1  # the block whose tensors show its slot
        self._queued = False  # copies were queued since the host last waited for the copy stream
        self._grad_hooks: dict[int, object] = {}  # id(parameter) -> its gradient hook
        self.ring: SlotRing | None = None  # made by enable, dropped by disable, like the rest of this group
        self.plans: list[BlockPlan] = []
        self.homes: Homes | None = None  # what every streamed block shows at home, checked before each pass
        self.copy_stream = None
        self.resident_device: dict[torch.dtype, torch.Tensor] = {}
        self.resident_views: list[torch.Tensor] = []
        self.saved = SavedSlots(self)
        self.epoch = 0  # counts enables: autograd's references to slots are valid within one
        self.activation_bytes: int | None = None  # device memory a forward took beyond the weights, once measured
        self._measure_from = 0  # device memory allocated when the first pass began
        self._plan(list(blocks))

    def _plan(self, blocks: list[tuple[str, nn.Module]]) -> None:
        kept = set(self.kept_names)
        self.kept = [block for name, block in blocks if name in kept]
        streamed = [(name, block) for name, block in blocks if name not in kept]
        self.all_names = [name for name, _ in blocks]
        self.block_names = [name for name, _ in streamed]
        self.blocks = [block for _, block in streamed]
        self.depth = min(self.prefetch_depth, len(streamed) - 1)
        self.resident, self.units = split_units(self.model, streamed)  # kept blocks join the resident weights
        self.num_slots = self.depth + 1
        self.slot_shape = self.transport.slot_shape(slot_numel(self.units))

    def _replan(self) -> None:
        found = blocks_now(self.model, self.all_names)  # by name, or found again after a shortened list
        self.kept_names = [name for name, _ in found if name in set(self.kept_names)]
        self._plan(found)

    def host_units(self) -> list:
        """The units whose homes the placement policy decides: blocks are streamed every step."""
        return self.transport.host_units()

    def describe(self) -> str:
        return type(self.model).__name__

    @property
    def name(self) -> str:
        return f"{self.strategy} {type(self.model).__name__}"

    def modules(self) -> list[nn.Module]:
        return [self.model]

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
        return self.resident_bytes + self.num_slots * self.slot_bytes + self.transport.device_bytes()

    @property
    def host_bytes(self) -> int:
        return self.resident.nbytes + self.transport.host_bytes()

    @property
    def slots(self) -> list[dict[torch.dtype, torch.Tensor]]:
        return self.ring.slots

    # -- lifecycle ------------------------------------------------------------------------
    def enable(self, txn: Transaction) -> None:
        backend = self.backend
        default_placement(self, txn)
        self.copy_stream = self.transport.new_stream(backend)
        self.ring = SlotRing(backend, self.slot_shape, self.num_slots, functools.partial(_slot_label, weakref.ref(self)))
        self.transport.allocate()
        resident_device = allocate_device(backend, self.resident.numel, f"resident weights of {self.name}")
        txn.on_rollback(self._release)
        self._queued = True  # from here copies may be in flight: a rollback waits for them before releasing
        txn.on_rollback(self.quiesce)
        self.transport.pack(txn)
        # The new buffers may reuse memory that compute issued earlier still reads (a caching
        # allocator hands freed blocks to the next allocation at once): copy after that compute.
        backend.wait_stream(self.copy_stream, backend.current_stream())
        self.placement.wait(copy_unit(self.resident, resident_device, self.placement, self.copy_stream, self.counters))
        done = backend.new_event()
        done.record(self.copy_stream)
        done.synchronize()
        self.resident_device = resident_device
        self.resident_views = self.resident.region_views(resident_device)
        txn.on_rollback(lambda: self.resident.bind(self.resident.host_views))
        self.resident.bind(self.resident_views)
        self.epoch += 1
        self.plans = [self._block_plan(i, backend.new_event()) for i in range(len(self.units))]
        self.homes = Homes([plan.binding for plan in self.plans])
        self.saved.index(self.ring.slots)
        # the ring's own references to each slot, counted at rest: more, later, means that
        # something outside the ring still holds the slot (see ring.py)
        self.ring.settle()
        # each undo registered before its step: an interrupt inside the step is undone too
        txn.on_rollback(self._remove_hooks)
        self._instrument()
        txn.on_rollback(lambda: setattr(self, "enabled", False))
        self.enabled = True
        logger.info(
            "%s offload of %s: %d blocks streamed, %d kept resident, %d slots of %.1f MB, %.1f MB resident%s",
            self.strategy, type(self.model).__name__, len(self.units), len(self.kept), self.num_slots,
            self.slot_bytes / 2**20, self.resident_bytes / 2**20,
            "; one block in one slot: its copy cannot overlap compute" if len(self.units) == 1 else "",
        )

    def _block_plan(self, i: int, ready, ticket=None) -> BlockPlan:
        """Block ``i``'s transfers into its slot and its binding to the slot's views."""
        unit, slot = self.units[i], i % self.num_slots
        buffers = self.ring.slots[slot]
        transfers, copies, nbytes, image = self.transport.plan(i, unit, buffers)
        binding = Binding(unit, self.home_views(i), unit.views(buffers))
        return BlockPlan(i, unit, slot, binding, transfers, copies, nbytes, image, self.transport.write_back(i), ready,
                         ticket)

    def _instrument(self) -> None:
        for i, block in enumerate(self.blocks):
            self._wrap(block, functools.partial(self._before_block, i), functools.partial(self._after_block, i))
        kept = set(self.kept_names)
        following = 0  # streamed blocks before each kept one
        for name in self.all_names:
            if name in kept:
                block = self.model.get_submodule(name)
                self._wrap(block, functools.partial(self._before_kept, following), _nothing)
            else:
                following += 1
        self._wrap(self.model, self._begin_pass, self._end_pass, self.backend.device())
        self._hooks.extend(self.transport.instrument())

    def home_views(self, i: int) -> list:
        """What block ``i``'s tensors show outside its forward: its host buffer, or placeholders."""
        return self.units[i].host_views

    def truth(self) -> list:
        """(unit, views its owners show, buffers holding its true values) per unit."""
        return [(self.resident, self.resident_views, self.resident_device), *self.transport.truth()]

    def disable(self) -> None:
        """Wait for queued copies, give every tensor back an ordinary host copy (changes made on
        the device to resident tensors included), free the device. Can be called again after an
        interruption, and does nothing once done."""
        with self.lock:
            if self.enabled:
                self.transport.restore()  # collective when sharded; raises, changing nothing, out of step
            self._remove_hooks()
            if not self.enabled:
                return
            if self.ring is not None:  # else a disable interrupted after releasing it: nothing in flight
                self.quiesce()
            self.plans, self.homes = [], None  # what references the homes goes first: each is freed once unpacked
            if self.resident.host:
                adopt_foreign(self.backend, self.resident, self.resident_views)  # the user's same-shape tensors
                write_back(self.backend, [
                    (self.resident.host[dtype], buf) for dtype, buf in self.resident_device.items()
                ])
            # each block from the views it shows at home
            unpack_units([(self.resident, self.resident_views), *self.units], self.placement)
            self._release()
            self.enabled = False

    def _release(self) -> None:
        self.ring = None
        self.plans = []
        self.homes = None
        self.transport.release()
        while self._grad_hooks:
            self._grad_hooks.popitem()[1].remove()
        self.saved.index([])
        self.resident_device = {}
        self.resident_views = []
        self._queued = False
        self._preloaded = []

    def quiesce(self, forget: bool = True) -> None:
        """Wait until no queued copy reads host memory any more; forget what the slots hold
        (unless ``forget`` is False: the slots keep blocks a backward will read)."""
        if self._queued:  # the whole stream: a load interrupted half-way recorded no event
            self.placement.drain()  # loads handed to the stager are on the stream first
            self.copy_stream.synchronize()
            self.landed()
        if forget:
            self.ring.forget()

    def landed(self) -> None:
        """Every load queued so far has landed (the host waited for the copy stream)."""
        self._queued = False
        for plan in self.plans:
            plan.ticket = None

    def repack_refusal(self) -> Exception | None:
        return self.transport.repack_refusal()

    # -- keeping the model and its packing in step ------------------------------------------
    def _reconcile(self, blocks) -> None:
        """Before a pass: every block must still show its host views (see ``Part.reconcile`` and
        the transport's ``replaced``)."""
        for i in blocks:
            if self.plans[i].image is not None:
                check_placeholders(self.units[i].host_views, f"block {self.block_names[i]} of {self.describe()}")
        self.reconcile(self.transport.replaced(blocks))

    def no_ram_home(self, i: int) -> Exception:
        """The error for a change to block ``i``, which has no home in RAM to take it."""
        return OffloadedModelError(
            f"block {self.block_names[i]} of {self.describe()} has its home on disk (a host_memory budget): "
            "it has no host copy to change. Call handle.disable() first, or give it RAM"
        )

def _nothing(failed: bool) -> None:
    pass


def _slot_label(strategy: "weakref.ref[LayerwiseOffload]", slot: int) -> str:
    """What a slot holds, for error reports: evaluated only when a report is written."""
    self = strategy()
    if self is None or self.ring is None:
        return f"slot {slot} of a layerwise offload that was disabled"
    occupant = self.ring.occupant[slot] if slot < len(self.ring.occupant) else -1
    holding = f"block {self.block_names[occupant]}" if occupant >= 0 else "no block yet"
    return f"slot {slot} of {self.name} ({holding})"
