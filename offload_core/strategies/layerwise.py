"""Layerwise offloading: blocks stream through a fixed ring of device slots.

A block's tensors show its device slot only while the block's own forward runs; before and
after, they show the block's host buffer, the truth. So whatever the user does between forwards
(``load_state_dict``, in-place edits, LoRA fusing, reading a weight, calling a child module from
elsewhere) reads and writes the truth, and a copy never computes on another block's weights.

The streaming has four pieces: the slot ring (ring.py: slots, their free events and occupants,
the check that nothing outside the ring still holds a slot), one :class:`LoadRecord` per streamed
block (its binding, transfers and ready event), a home policy (homes.py: what each block's home
is, and which changes it takes) and a transport (transport.py: a plain copy of the block's home;
gather.py: a rank's shard plus an all-gather) that fills a slot. The part keeps its
lifecycle here (enable, park and unpark, re-layout, disable) and composes the protocol that ties
the pieces together: its loader (loader.py) does every load, the transport only says what a load
issues and which blocks it needs loaded; its passes (passes.py) run the protocol below around each
model and block forward; its checks (checks.py) take in what the user changed.

The protocol, pass by pass:

A model forward is one *pass*. It starts by re-packing the model if its structure changed (a
module, Parameter or buffer added: the registration hooks say so) and checking the blocks'
buffers (the home policy's ``unchanged``: across ranks, every tensor, see homes.py); when its
first block is reached (after the model's own pre-hooks, which may have edited weights) it
queues blocks ``0 .. prefetch_depth`` into their slots. Before block ``i`` runs, its wrapper
makes sure ``i`` is the occupant of its slot (else loads it synchronously and counts a miss),
queues the next ``prefetch_depth`` blocks, checks that ``i``'s tensors still show its host
buffer (a parameter given new data of the same layout is copied into it and ``i`` loaded again;
one given data of another layout runs this call on a device copy of it, and the next call
re-packs), makes the compute stream wait for ``i``'s ready event and binds ``i`` to its slot;
after it, the slot is marked free with an event on the compute stream, changes the forward made
to the block's tensors are copied home, and ``i`` is bound to its host buffer again.
A copy into a slot always waits for the slot's free event. When the pass ends the host waits for
the last queued copy, so host memory is never written while a copy still reads it, and nothing
stays in a slot across passes: a block is loaded afresh in every pass, from the host as it is
then. (A pass that saved weights for a backward leaves its last blocks in their slots for it; see
autograd.py.)

A block called outside a model forward is loaded synchronously (a miss) and dropped after.

Inside ``handle.frozen()`` (every pipeline call without step callbacks is), the user promises not
to change weights between forwards: the end of a pass then queues the first blocks of the next, so
that their copies overlap whatever runs between two forwards (a scheduler step, the embeddings). A
change the handle can see (a parameter given new data, a buffer replaced, a module added, a dtype
change, an in-place write through a parameter, which moves its version: a pipeline's pre-hook
editing a block's weight) still drops those copies and loads afresh; an in-place write through
``.data`` it cannot see, which is what the promise is about.

Blocks whose home is not pinned (a ``pinned_memory`` budget, or on disk with ``host_memory``) are
loaded by the placement's stager thread through its bounce ring: a load then hands the whole
load (slot wait, copies, ready event) to the stager, and the block's ticket is waited before
compute waits on its ready event. As the stager starts each load, the blocks on disk that run
after it (wrapping to the first for the next step) are read ahead.


Blocks kept resident (``resident_blocks``, partial residency) are part of the resident weights:
on the device for the whole time, like the model's non-block weights. Streamed blocks between
them copy while they compute; the first kept block reached starts the pass like a streamed one.

A model with one streamed block gets one slot: nothing can be copied while the block computes, so
its copy at the start of each forward cannot overlap (the enable log says so).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from operator import attrgetter
from typing import Sequence

import torch
from torch import nn

from ..device.backend import DeviceBackend
from ..base.locks import locked
from ..common.transaction import Transaction
from ..weights import nbytes_of, split_units
from ..weights.binding import Binding, Home
from ..hostmem.placement import SWITCH, HostUnit
from .autograd import SavedSlots
from .checks import Checks
from .homes import PartWeights, WholeHomePolicy
from .common import default_placement, unpack_units
from .held import HeldWeights
from .loader import BlockLoader
from .part import Part, blocks_now
from .passes import Passes
from .ring import LoadRecord, SlotRing, slot_numel
from .transport import CopyTransport, LoadContext, Transport, copy_stream

logger = logging.getLogger(__name__)


class LayerwiseOffload(Part):
    """Streams the blocks of one model; everything outside the streamed blocks stays resident.

    The part keeps its lifecycle (enable, park and unpark, re-layout, disable) and composes its
    loader (loader.py: the ring, copy stream and load records), its checks (checks.py) and its
    passes (passes.py: the block and model hooks)."""

    def __init__(
        self,
        model: nn.Module,
        blocks: Sequence[tuple[str, nn.Module]],
        backend: DeviceBackend,
        prefetch_depth: int = 1,
        transport: Transport | None = None,
        resident_blocks: Sequence[int] = (),
        home_policy: WholeHomePolicy | None = None,
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
        self.home_policy = home_policy or WholeHomePolicy()  # what each block's home is, which changes it takes
        self.strategy = self.transport.strategy
        self.label = type(model).__name__  # names timeline spans: "<label>.<block name>"
        self.kept_names = [name for k, (name, _) in enumerate(blocks) if k in kept]
        self.prefetch_depth = prefetch_depth
        self.held: HeldWeights | None = None  # the resident weights and kept blocks on the device, made by enable
        self._relayout: tuple[int, ...] | None = None  # the kept blocks a re-plan chose, taken as the part next begins
        self.parks = False  # it gives up the device while other components' phases run (set before enable)
        self.saved = SavedSlots(self)
        self._enables = 0  # autograd's references to slots are valid within one enable (``epoch``)
        self.activation_bytes: int | None = None  # device memory a forward took beyond the weights, once measured
        self.loader = BlockLoader(self, backend, self.transport)
        self.checks = Checks(self, self.loader)
        self.passes = Passes(self, self.loader, self.checks)
        # the collaborators' verbs the backward, the checks and the tests call on the part, bound once
        self.load, self.wait_ready, self.quiesce = self.loader.load, self.loader.wait_ready, self.loader.quiesce
        self.load_for_backward, self.end_backward = self.loader.load_for_backward, self.passes.end_backward
        self.substituted = self.passes.substituted
        self._split_blocks(list(blocks))

    def _split_blocks(self, blocks: list[tuple[str, nn.Module]], units: dict | None = None) -> None:
        """Sort ``blocks`` into kept and streamed; their units split from the model, or ``units``
        (by name: a re-layout keeps each block's unit and its home)."""
        named, kept = dict(blocks), set(self.kept_names)
        kept_blocks = [(name, named[name]) for name in self.kept_names]
        self.kept = [block for _, block in kept_blocks]
        streamed = [(name, block) for name, block in blocks if name not in kept]
        self.all_names = [name for name, _ in blocks]
        self.block_names = [name for name, _ in streamed]
        self.blocks = [block for _, block in streamed]
        self.depth = min(self.prefetch_depth, len(streamed) - 1)
        # a kept block is a unit of its own: its home may be elsewhere than the resident weights'
        # (read once per phase switch, it needs no second copy in RAM), and it parks with them
        if units is None:
            self.resident, split = split_units(self.model, streamed + kept_blocks)
        else:
            split = [units[name] for name, _ in streamed + kept_blocks]
        self.units, self.kept_units = split[: len(streamed)], split[len(streamed):]
        self.num_slots = self.depth + 1
        self.slot_shape = self.home_policy.slot_shape(slot_numel(self.units))

    @property
    def block_units(self) -> list:
        """Every block's unit, streamed or kept, in the model's order."""
        by_name = dict(zip([*self.block_names, *self.kept_names], [*self.units, *self.kept_units]))
        return [by_name[name] for name in self.all_names]

    def _split_units(self) -> None:
        found = blocks_now(self.model, self.all_names)  # by name, or found again after a shortened list
        self.kept_names = [name for name, _ in found if name in set(self.kept_names)]
        self._split_blocks(found)

    def host_units(self) -> list:
        """The units whose homes the placement policy decides: blocks are streamed every step; kept
        blocks, and the resident weights of a part that parks, are read once per phase switch."""
        units = self.home_policy.host_units(self.resident, self.units)
        if self.parks:
            units[0] = dataclasses.replace(units[0], role=SWITCH)
        return units + [HostUnit(u, SWITCH, u.nbytes) for u in self.kept_units]

    def describe(self) -> str:
        return type(self.model).__name__

    @property
    def name(self) -> str:
        return f"{self.strategy} {type(self.model).__name__}"

    def modules(self) -> list[nn.Module]:
        return [self.model]

    # what the loader holds, read on the part (by the backward, and by tests): C-level getters
    ring = property(attrgetter("loader.ring"))
    records = property(attrgetter("loader.records"))
    copy_stream = property(attrgetter("loader.copy_stream"))
    _queued = property(attrgetter("loader.queued"))

    slots = property(lambda self: list(self.loader.ring))  # each slot's buffers, for tests

    # -- sizes ----------------------------------------------------------------------------
    @property
    def resident_bytes(self) -> int:
        """Its resident weights and kept blocks: what it holds on the device besides its slots."""
        return self.resident.nbytes + sum(u.nbytes for u in self.kept_units)

    @property
    def slot_bytes(self) -> int:
        return nbytes_of(self.slot_shape)

    @property
    def device_weight_bytes(self) -> int:
        """Device bytes this strategy holds: resident + slots x largest block (per dtype)."""
        return (self.resident_bytes + self.num_slots * self.slot_bytes
                + self.transport.device_bytes(len(self.units), self.num_slots, self.slot_shape))

    @property
    def host_bytes(self) -> int:
        return self.resident_bytes + self.home_policy.host_bytes(self.units)

    # -- lifecycle ------------------------------------------------------------------------
    def enable(self, txn: Transaction) -> None:
        default_placement(self, txn)
        self.loader.copy_stream = copy_stream(self.backend, self.transport.collective)
        self.held = HeldWeights([self.resident, *self.kept_units], self.parks)
        txn.on_rollback(self._release)  # before the first allocation: one that fails frees the others at once
        # a part that parks starts parked: its phase has not begun, and another's may hold the device
        self._allocate() if not self.parks else self._serve(None)
        self.loader.queued = True  # from here copies may be in flight: a rollback waits for them before releasing
        txn.on_rollback(self.quiesce)
        self.home_policy.pack(self.placement, txn)
        if not self.parks:
            txn.on_rollback(self._unbind_held)
            self._fill()
        self._enables += 1
        # each undo registered before its step: an interrupt inside the step is undone too
        txn.on_rollback(self._remove_hooks)
        self._instrument()
        txn.on_rollback(lambda: setattr(self, "enabled", False))
        self.enabled = True
        logger.info(
            "%s offload of %s: %d blocks streamed, %d kept resident, %d slots of %.1f MB, %.1f MB resident%s%s",
            self.strategy, type(self.model).__name__, len(self.units), len(self.kept), self.num_slots,
            self.slot_bytes / 2**20, self.resident_bytes / 2**20,
            "; one block in one slot: its copy cannot overlap compute" if len(self.units) == 1 else "",
            "; it parks while other components' phases run" if self.parks else "",
        )

    def _allocate(self) -> None:
        """The device memory the part holds while it is not parked: its slot ring (and what the
        transport needs beside it), its resident weights and kept blocks."""
        backend = self.backend
        self.loader.ring = SlotRing(backend, self.slot_shape, self.num_slots,
                                    functools.partial(_slot_label, weakref.ref(self)))
        self._serve(self.loader.ring)
        self.held.allocate(backend, self.name)

    def _serve(self, ring: SlotRing | None) -> None:
        """Hand the home policy the weights it keeps, and the transport what its loads use."""
        weights = PartWeights.of(self)
        self.home_policy.serve(weights)
        self.transport.serve(LoadContext(self.backend, self.placement, self.loader.copy_stream, ring,
                                         self.loader.landed, weights.names))

    def _fill(self) -> None:
        """Copy the resident weights and kept blocks into the device memory :meth:`_allocate`
        made, bind them, and record the blocks' loads into the new slots."""
        backend = self.backend
        # The new buffers may reuse memory that compute issued earlier still reads (a caching
        # allocator hands freed blocks to the next allocation at once): copy after that compute.
        backend.wait_stream(self.copy_stream, backend.current_stream())
        self.held.fill(self.placement, self.copy_stream, self.counters)
        done = backend.new_event()
        done.record(self.copy_stream)
        done.synchronize()
        self.held.bind()
        self.loader.make_records()

    def _unbind_held(self) -> None:
        """Undo of :meth:`_fill`'s binding: the held units show their homes again."""
        for unit in self.held.units:
            unit.bind(unit.host_views)

    # -- phases (see phases.py) ----------------------------------------------------------------
    @property
    def parked(self) -> bool:
        return self.enabled and self.loader.ring is None

    def park(self) -> None:
        """Another component's phase begins: give up the device (slots, resident weights, kept
        blocks); their homes are the truth until the part runs again. Outside any pass, and not
        while a backward may still read what a forward saved (until that backward, or the part's
        next forward)."""
        locked(self.lock, self._park)

    def _park(self) -> None:
        passes = self.passes
        if not self.enabled or self.loader.ring is None or passes.running or passes.bound >= 0 or self.saved.recorded:
            return
        logger.debug("%s parks: its phase is over", self.describe())
        self.quiesce()
        self.loader.ring = None  # parked from here: an interrupt below is finished by the next unpark
        self._send_held_home()
        self._drop_device()
        self._serve(None)

    def _send_held_home(self) -> None:
        if self.held.unbind_home(self.backend):
            self.dirty = True  # a tensor of another layout was kept: re-pack before the next use

    def unpark(self) -> None:
        """The part runs again: its device memory back, its resident weights and kept blocks loaded."""
        logger.debug("%s loads its resident weights and kept blocks back", self.describe())
        if self.held.bindings:  # a park an interrupt stopped half-way
            self._send_held_home()
        # while parked they showed their homes: new data given them since is taken in first
        self.reconcile((u, u.host_views) for u in self.held.units if not Home(u, u.host_views).at_home())
        try:
            self._allocate()
            self.loader.queued = True
            self._fill()
            self.counters.switch_h2d_bytes += self.held.nbytes
        except BaseException:
            self.quiesce()
            if self.held.bindings:
                self._send_held_home()
            self._drop_device()  # parked again: the next use retries
            raise

    def measured_activations(self) -> dict[str, int]:
        return {self.label: self.activation_bytes} if self.activation_bytes is not None else {}

    def relayout(self, kept: Sequence[int]) -> None:
        """Keep blocks ``kept`` (indices) from the next time the part begins (a re-plan). Only a
        part that parks: it loads its kept blocks at each switch anyway, and their homes stay."""
        self._relayout = tuple(kept)

    def _apply_layout(self) -> None:
        """The kept blocks a re-plan chose, taken between calls: the part parks (if a backward may
        still come, later), its blocks are sorted into kept and streamed anew (each keeps its unit
        and its home), the block wrappers follow, and it loads back as it begins."""
        self.park()
        if self.loader.ring is not None:
            return
        by_name = dict(zip(self.all_names, self.block_units))
        self.kept_names = [self.all_names[i] for i in self._relayout]
        self._relayout = None
        self._split_blocks([(name, self.model.get_submodule(name)) for name in self.all_names], by_name)
        self.held = HeldWeights([self.resident, *self.kept_units], self.parks)
        self._serve(None)
        self._remove_hooks()  # the wrappers name blocks by their place among the streamed ones
        self._instrument()

    def yields(self) -> list[str]:
        return [self.label] if self.parks else []

    def give_way(self, component: str) -> None:
        self.park()

    def _load_record(self, i: int, ready, ticket=None) -> LoadRecord:
        """Block ``i``'s transfers into its slot and its binding to the slot's views."""
        unit, ring = self.units[i], self.loader.ring
        slot = ring.slot_of(i)
        buffers = ring.buffers_at(slot)
        transfers, copies, nbytes, image, write_back = self.transport.prepare_load(i, unit, buffers)
        binding = Binding(unit, self.home_views(i), unit.views(buffers))
        return LoadRecord(i, unit, slot, binding, transfers, copies, nbytes, image, write_back, ready, ticket)

    def _load_first(self) -> None:
        self.passes.load_first()

    def freeze(self) -> None:
        locked(self.lock, self.passes.count_freeze, 1)

    def thaw(self) -> None:
        locked(self.lock, self.passes.count_freeze, -1)

    def _instrument(self) -> None:
        self.passes.instrument()

    def home_views(self, i: int) -> list:
        """What block ``i``'s tensors show outside its forward: its host buffer, or placeholders."""
        return self.units[i].host_views

    def truth(self) -> list:
        """(unit, views its owners show, buffers holding its true values) per unit."""
        return [*self.held.truth(), *self.home_policy.truth()]

    def disable(self) -> None:
        """Wait for queued copies, give every tensor back an ordinary host copy (changes made on
        the device to resident tensors included), free the device. Can be called again after an
        interruption, and does nothing once done."""
        locked(self.lock, self._disable)

    def _disable(self) -> None:
        if self.enabled:
            self.loader.restore()  # collective when sharded; raises, changing nothing, out of step
        self._remove_hooks()
        if not self.enabled:
            return
        if self.loader.ring is not None:  # else parked, or a disable interrupted after releasing it: nothing in flight
            self.quiesce()
        # what references the homes goes first: each is freed once unpacked
        self.loader.records, self.loader.homes = [], None
        if self.held.bindings:  # a part that parks goes home as it parks
            self._send_held_home()
        held = [(unit, views) for unit, views, _ in self.held.truth()]
        self.held.copy_home(self.backend)  # on the device, their truth
        # the held units from the views they show, each block from the views it shows at home
        unpack_units([*held, *self.units], self.placement)
        self._release()
        self.enabled = False

    def _release(self) -> None:
        self._drop_device()
        self.transport.serve(None)
        self.home_policy.release()

    def _drop_device(self) -> None:
        """Forget every device buffer the part holds (the slots, the held weights) and what refers
        to them: the blocks' load records, their gradient hooks (bound to a record's ready event), the
        backward's slot index."""
        self.loader.drop()
        self.passes.drop_gradient_hooks()
        self.saved.index({})
        if self.held is not None:
            self.held.free()
        self.loader.queued = False
        self.passes.preloaded = []

    def repack_refusal(self) -> Exception | None:
        return self.home_policy.repack_refusal()

    # -- autograd (see autograd.py: what it reads of the part is its ``StreamedPart``) ----------
    @property
    def epoch(self) -> int | None:
        """The enable whose slots autograd's references may read: None while disabled."""
        return self._enables if self.enabled else None

    def block_label(self, i: int) -> str:
        return f"block {self.block_names[i]} of {self.describe()}"


def _slot_label(strategy: "weakref.ref[LayerwiseOffload]", slot: int) -> str:
    """What a slot holds, for error reports: evaluated only when a report is written."""
    self = strategy()
    if self is None or self.loader.ring is None:
        return f"slot {slot} of a layerwise offload that was disabled"
    occupant = self.loader.ring.occupant(slot)
    holding = f"block {self.block_names[occupant]}" if occupant >= 0 else "no block yet"
    return f"slot {slot} of {self.name} ({holding})"
