"""Layerwise offloading: blocks stream through a fixed ring of device slots.

A block's tensors show its device slot only while the block's own forward runs; before and
after, they show the block's host buffer, the truth. So whatever the user does between forwards
(``load_state_dict``, in-place edits, LoRA fusing, reading a weight, calling a child module from
elsewhere) reads and writes the truth, and a copy never computes on another block's weights.

The part has three pieces: the slot ring (ring.py: slots, their free events and occupants, the
check that nothing outside the ring still holds a slot), one :class:`LoadRecord` per streamed block
(its binding, transfers and ready event), and a transport (transport.py: a plain copy of the
block's home; gather.py: a rank's shard plus an all-gather) that fills a slot. The part is the
protocol that ties them together, and does every load itself: the transport only says what a load
issues, and which blocks it needs loaded.

The protocol, pass by pass:

A model forward is one *pass*. It starts by re-packing the model if its structure changed (a
module, Parameter or buffer added: the registration hooks say so) and checking the blocks'
buffers (the transport's ``unchanged``: across ranks, every tensor, see transport.py); when its
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
from typing import Sequence

import torch
from torch import nn
from torch.nn.modules.module import _global_forward_pre_hooks as _global_pre_hooks

from ..device.backend import DeviceBackend
from ..errors import OffloadedModelError
from ..locks import locked
from ..timeline import UNTRACED
from ..transaction import Transaction
from ..weights import nbytes_of, split_units
from ..weights.binding import Binding, Home, Homes
from ..hostmem.placement import SWITCH, HostUnit
from ..weights.placeholders import check_placeholders
from .autograd import SavedSlots, backward_running, refuse_function_transforms
from .calls import calls_running
from .common import default_placement, device_copy, unpack_units
from .held import HeldWeights
from .part import Part, adopt_foreign, blocks_now, changed_during_call
from .ring import LoadRecord, SlotRing, kept_views, slot_numel
from .transport import CopyTransport, Served

logger = logging.getLogger(__name__)


class LayerwiseOffload(Part):
    """Streams the blocks of one model; everything outside the streamed blocks stays resident."""

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
        self.records: list[LoadRecord] = []
        self.homes: Homes | None = None  # what every streamed block shows at home, checked before each pass
        self.copy_stream = None
        self.held: HeldWeights | None = None  # the resident weights and kept blocks on the device, made by enable
        self._images: tuple = ()  # the streamed blocks' disk images (None: in RAM), in run order
        self._relayout: tuple[int, ...] | None = None  # the kept blocks a re-plan chose, taken as the part next begins
        self.parks = False  # it gives up the device while other components' phases run (set before enable)
        self.saved = SavedSlots(self)
        self._enables = 0  # autograd's references to slots are valid within one enable (``epoch``)
        self.activation_bytes: int | None = None  # device memory a forward took beyond the weights, once measured
        self._measure_from = 0  # device memory allocated when the first pass began
        self._split_blocks(list(blocks))

    def _split_blocks(self, blocks: list[tuple[str, nn.Module]]) -> None:
        kept = set(self.kept_names)
        kept_blocks = [(name, block) for name, block in blocks if name in kept]
        self.kept = [block for _, block in kept_blocks]
        streamed = [(name, block) for name, block in blocks if name not in kept]
        self.all_names = [name for name, _ in blocks]
        self.block_names = [name for name, _ in streamed]
        self.blocks = [block for _, block in streamed]
        self.depth = min(self.prefetch_depth, len(streamed) - 1)
        # a kept block is a unit of its own: its home may be elsewhere than the resident weights'
        # (read once per phase switch, it needs no second copy in RAM), and it parks with them
        self.resident, units = split_units(self.model, streamed + kept_blocks)
        self.units, self.kept_units = units[: len(streamed)], units[len(streamed):]
        self.num_slots = self.depth + 1
        self.slot_shape = self.transport.slot_shape(slot_numel(self.units))

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
        units = self.transport.host_units(self.resident, self.units)
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
                + self.transport.device_bytes(self.units, self.num_slots, self.slot_shape))

    @property
    def host_bytes(self) -> int:
        return self.resident_bytes + self.transport.host_bytes(self.units)

    @property
    def slots(self) -> list[dict[torch.dtype, torch.Tensor]]:
        return list(self.ring)

    # -- lifecycle ------------------------------------------------------------------------
    def enable(self, txn: Transaction) -> None:
        default_placement(self, txn)
        self.copy_stream = self.transport.new_stream(self.backend)
        self.held = HeldWeights([self.resident, *self.kept_units], self.parks)
        txn.on_rollback(self._release)  # before the first allocation: one that fails frees the others at once
        # a part that parks starts parked: its phase has not begun, and another's may hold the device
        self._allocate() if not self.parks else self._serve(None)
        self._queued = True  # from here copies may be in flight: a rollback waits for them before releasing
        txn.on_rollback(self.quiesce)
        self.transport.pack(txn)
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
        self.ring = SlotRing(backend, self.slot_shape, self.num_slots, functools.partial(_slot_label, weakref.ref(self)))
        self._serve(self.ring)
        self.transport.allocate()
        self.held.allocate(backend, self.name)

    def _serve(self, ring: SlotRing | None) -> None:
        self.transport.serve(Served(
            self.backend, self.placement, self.copy_stream, ring, self.model, self.blocks, self.block_names,
            self.resident, self.units, self.describe(), self.name, self.landed, self.kept_units))

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
        self.records = [self._load_record(i, backend.new_event()) for i in range(len(self.units))]
        self.homes = Homes([record.binding for record in self.records])
        self._images = tuple(record.image for record in self.records)  # what the read-ahead is told about
        self.saved.index(self.ring.views_index())
        # the ring's own references to each slot, counted at rest: more, later, means that
        # something outside the ring still holds the slot (see ring.py)
        self.ring.settle()

    def _unbind_held(self) -> None:
        """Undo of :meth:`_fill`'s binding: the held units show their homes again."""
        for unit in self.held.units:
            unit.bind(unit.host_views)

    # -- phases (see phases.py) ----------------------------------------------------------------
    @property
    def parked(self) -> bool:
        return self.enabled and self.ring is None

    def park(self) -> None:
        """Another component's phase begins: give up the device (slots, resident weights, kept
        blocks); their homes are the truth until the part runs again. Outside any pass, and not
        while a backward may still read what a forward saved (until that backward, or the part's
        next forward)."""
        locked(self.lock, self._park)

    def _park(self) -> None:
        if not self.enabled or self.ring is None or self._passes or self._bound >= 0 or self.saved.recorded:
            return
        logger.debug("%s parks: its phase is over", self.describe())
        self.quiesce()
        self.ring = None  # parked from here: an interrupt below is finished by the next unpark
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
            self._queued = True
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
        if self.ring is not None:
            return
        by_name = dict(zip(self.all_names, self.block_units))
        self.kept_names = [self.all_names[i] for i in self._relayout]
        self._relayout = None
        kept = set(self.kept_names)
        streamed = [name for name in self.all_names if name not in kept]
        self.kept = [self.model.get_submodule(name) for name in self.kept_names]
        self.blocks, self.block_names = [self.model.get_submodule(name) for name in streamed], streamed
        self.units, self.kept_units = [by_name[n] for n in streamed], [by_name[n] for n in self.kept_names]
        self.depth = min(self.prefetch_depth, len(streamed) - 1)
        self.num_slots = self.depth + 1
        self.slot_shape = self.transport.slot_shape(slot_numel(self.units))
        self.held = HeldWeights([self.resident, *self.kept_units], self.parks)
        self._serve(None)
        self._remove_hooks()  # the wrappers name blocks by their place among the streamed ones
        self._instrument()

    def yields(self) -> list[str]:
        return [self.label] if self.parks else []

    def give_way(self, component: str) -> None:
        self.park()

    def _enter(self) -> None:
        """Before the part runs (a pass, or a block called on its own): when it is parked, the
        phase switch parks whoever the plan gives up for it, then the part loads itself back."""
        if self.switch is not None:
            self.switch.entering(self.label)
        if self.ring is None:
            self.unpark()
            if self.switch is not None:
                self.switch.loaded_back(self.label)

    def _load_record(self, i: int, ready, ticket=None) -> LoadRecord:
        """Block ``i``'s transfers into its slot and its binding to the slot's views."""
        unit, slot = self.units[i], self.ring.slot_of(i)
        buffers = self.ring.buffers_at(slot)
        transfers, copies, nbytes, image = self.transport.prepare_load(i, unit, buffers)
        binding = Binding(unit, self.home_views(i), unit.views(buffers))
        return LoadRecord(i, unit, slot, binding, transfers, copies, nbytes, image, self.transport.write_back(i), ready,
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
        return [*self.held.truth(), *self.transport.truth()]

    def disable(self) -> None:
        """Wait for queued copies, give every tensor back an ordinary host copy (changes made on
        the device to resident tensors included), free the device. Can be called again after an
        interruption, and does nothing once done."""
        locked(self.lock, self._disable)

    def _disable(self) -> None:
        if self.enabled:
            self._restore()  # collective when sharded; raises, changing nothing, out of step
        self._remove_hooks()
        if not self.enabled:
            return
        if self.ring is not None:  # else parked, or a disable interrupted after releasing it: nothing in flight
            self.quiesce()
        self.records, self.homes = [], None  # what references the homes goes first: each is freed once unpacked
        if self.held.bindings:  # a part that parks goes home as it parks
            self._send_held_home()
        held = [(unit, views) for unit, views, _ in self.held.truth()]
        self.held.copy_home(self.backend)  # on the device, their truth
        # the held units from the views they show, each block from the views it shows at home
        unpack_units([*held, *self.units], self.placement)
        self._release()
        self.enabled = False

    def _restore(self) -> None:
        """Before ``disable`` unpacks: every unit gets its full host values, by the loads the
        transport asks for (a rank's shards: every block gathered once more and read back)."""
        # blocks loaded early inside frozen() were gathered with the other ranks' next loads: they
        # are this disable's first loads, as they would be a forward's, not loaded again
        preloaded, self._preloaded = {i for i, _ in self._preloaded}, []
        with self.transport.restoring() as blocks:
            if not blocks:  # every unit has its full host values already
                return
            reader = self.backend.new_stream()
            try:
                self.quiesce(forget=not preloaded)
                for i in blocks:
                    if i not in preloaded or not self.ring.holds(i):
                        self.load(i)
                    self.wait_ready(i, reader)
                    self.transport.read_back(i, reader)
            finally:
                self.quiesce()

    def _release(self) -> None:
        self._drop_device()
        self.transport.release()

    def _drop_device(self) -> None:
        """Forget every device buffer the part holds (the slots, the held weights) and what refers
        to them: the blocks' load records, their gradient hooks (bound to a record's ready event), the
        backward's slot index."""
        self.ring = None
        self.records = []
        self.homes = None
        while self._grad_hooks:
            self._grad_hooks.popitem()[1].remove()
        self.saved.index({})
        if self.held is not None:
            self.held.free()
        self._queued = False
        self._preloaded = []

    def quiesce(self, forget: bool = True) -> None:
        """Wait until no queued copy reads host memory any more; forget what the slots hold
        (unless ``forget`` is False: the slots keep blocks a backward will read)."""
        if self._queued:  # the whole stream: a load interrupted half-way recorded no event
            self.placement.drain()  # loads handed to the stager are on the stream first
            self.copy_stream.synchronize()
            self.landed()
        if forget and self.ring is not None:
            self.ring.forget()

    def landed(self) -> None:
        """Every load queued so far has landed (the host waited for the copy stream)."""
        self._queued = False
        for record in self.records:
            record.ticket = None

    def repack_refusal(self) -> Exception | None:
        return self.transport.repack_refusal()

    # -- keeping the model and its packing in step ------------------------------------------
    def _reconcile(self, blocks, before_pass: bool = False) -> None:
        """Before a pass (``before_pass``: every block) or a block called alone: each of ``blocks``
        must still show its host views (see ``Part.reconcile`` and the transport's ``replaced``)."""
        for i in blocks:
            self._check_placeholders(i)
        self.reconcile(self._replaced(blocks, before_pass))

    def _check_placeholders(self, i: int) -> None:
        if self.records[i].image is not None:
            check_placeholders(self.units[i].host_views, f"block {self.block_names[i]} of {self.describe()}")

    def _retake(self, i: int) -> None:
        """Block ``i`` is about to bind, inside a pass (or run again inside a backward, where a
        re-pack must wait for the next call as well): code run since its load was queued (the
        model's pre-hooks and forward, another block's hooks) or, on one process, since the last
        call (the pass began with the buffers alone, see ``CopyTransport.unchanged``) may have
        given one of its tensors new data. Taken in as at the beginning (``Part.reconcile``) and
        the block loaded again. A parameter given data of another layout cannot be packed around
        now (the pass's blocks are bound): this call runs it on a device copy of that data
        (``_substitute``), and the next re-packs. Any other structural change is refused for this
        call (docs/design.md, row 11)."""
        self._check_placeholders(i)
        record = self.records[i]
        if record.binding.at_home():
            return
        if not list(self.transport.replaced([i], self.records, self.homes, False, False)):
            return
        self.quiesce(forget=False)  # copies queued earlier read the host as it was
        relaid = record.binding.relaid() if self.repack_refusal() is None else []
        if relaid:
            self.dirty = True  # first: an interrupt in the substitution still re-packs before the next call
            self._substitute(record, relaid)
        # as Part.reconcile, less its ``dirty`` (set by the substitution above, in this or an earlier block)
        if adopt_foreign(self.backend, record.unit, self._home_now(record)):
            raise changed_during_call(self, f"code run in this call before block {self.block_names[i]}")
        self.load(i)
        self.wait_ready(i)

    def _substitute(self, record: LoadRecord, relaid: list[int]) -> None:
        """Parameters ``relaid`` of ``record``'s block show data of another layout than their home:
        until the next call re-packs the block, it binds a device copy of that data, and goes
        home to the data itself (changes a forward makes copied into it)."""
        binding = record.binding
        ids = {id(binding.params[k]) for k in relaid}
        names = ", ".join(name for name, p in self.blocks[record.index].named_parameters() if id(p) in ids)
        logger.info(
            "%s: %s of block %s were given data of another shape, strides or dtype; this call computes with a device "
            "copy of it, the next packs the block again", self.describe(), names, self.block_names[record.index],
        )
        record.binding = binding.substituted({
            k: device_copy(self.backend, binding.params[k].data, f"new data of {names} ({self.name})") for k in relaid
        })

    def _home_now(self, record: LoadRecord) -> list:
        """What each of the block's tensors shows at home now: its home view, or the data of a
        parameter its binding substitutes (``_substitute``)."""
        binding, views = record.binding, self.home_views(record.index)
        if binding.base is None:
            return views
        shown = {id(home): now for home, now in zip(binding.base.params_home, binding.params_home)}
        return [shown.get(id(view), view) for view in views]

    def _replaced(self, blocks, before_pass: bool = False):
        """(unit, home views) of each of ``blocks`` the transport finds replaced (``Part.reconcile``),
        once the copies queued earlier (which read the host as it was) are done."""
        for i in self.transport.replaced(blocks, self.records, self.homes, self.dirty, before_pass):
            self.quiesce()
            yield self.units[i], self.home_views(i)

    # -- streaming ------------------------------------------------------------------------
    def load(self, i: int) -> None:
        """Queue block ``i``'s transfers into its slot once the slot's last reader is done."""
        record, ring = self.records[i], self.ring
        slot = record.slot
        if not ring.at_rest(slot):
            self._renew(slot)
            record = self.records[i]
        ring.release(slot)  # an interrupted load leaves the slot empty, not stale
        self._queued = True
        stager = self.placement.stager
        if stager is None:
            self._queue_load(record)
        else:
            # The stager waits on the slot's free event later: safe, because it is recorded again
            # only after block i has run, and block i runs only after this load's ticket.
            record.ticket = stager.submit(functools.partial(self._stage_load, record))
        ring.claim(slot, i)
        counters = self.counters
        counters.loads += 1
        counters.h2d_copies += record.copies
        counters.h2d_bytes += record.nbytes

    def _renew(self, slot: int) -> None:
        """Something outside the ring still references ``slot``: leave it that memory and make
        the load records of the slot's blocks again, for the new memory the ring gives the slot."""
        occupant = self.ring.occupant(slot)
        holding = f"block {self.block_names[occupant]}" if occupant >= 0 else "no block"
        old = self.ring.buffers_at(slot)
        if not self.ring.renew(slot, self.copy_stream, holding, self.describe()):
            return
        for where in kept_views(self.model, old):
            logger.warning(
                "%s: %s keeps a view of the device copy of offloaded weights across forwards: it reads the weights of "
                "the forward that made it, never later changes to them (also after disable()). Make it again in each "
                "forward, or keep a .clone()", self.describe(), where,
            )
        self.counters.retired_slot_bytes += self.ring.nbytes
        for j in self.ring.blocks_of(slot, len(self.records)):
            record = self.records[j]
            self.records[j] = self._load_record(j, record.ready, record.ticket)
        self.saved.index(self.ring.views_index())
        self.ring.settle(slot)

    def _stage_load(self, record: LoadRecord) -> None:
        """A load on the stager thread: the blocks on disk after this one are read ahead while
        it is staged (see ``hostmem.staging.ReadAhead``)."""
        self.placement.staging_block(self._images, record.index)
        self._queue_load(record)

    def _queue_load(self, record: LoadRecord) -> None:
        stream = self.copy_stream
        self.ring.wait_free(record.slot, stream)
        try:
            if self.timeline is None:
                self.transport.issue(record, stream)
            else:
                issue = functools.partial(self.transport.issue, record, stream)
                self.timeline.copy(stream, self._span_name(record.index), record.nbytes, issue)
        finally:  # also after a failure half-way: what waits for block i waits for what was queued
            record.ready.record(stream)

    def _begin_pass(self) -> None:
        refuse_function_transforms(self.describe())
        if self._passes or self._bound >= 0:  # rare: a nested pass, or one an interrupt tore
            self._repair(calls_running([self.model]) - 1)
        if self._relayout is not None and not self._passes:
            self._apply_layout()
        self._passes += 1
        if self._passes > 1:
            return
        if self.switch is not None or self.ring is None:
            self._enter()
        if self.saved.forget_backward():  # one that failed never reached its end
            self.end_backward()
        if self.saved.recorded:  # the slots kept for a backward are not trusted by a forward
            self.saved.recorded = False
            self.quiesce()
        self._reconcile(range(len(self.units)), before_pass=True)
        if self._preloaded and (self.model._forward_pre_hooks or _global_pre_hooks):
            # its pre-hooks may write the preloaded blocks' host weights: not while a copy reads them
            self.quiesce(forget=False)
        self._starting = True  # loads start at the first block: after the model's own pre-hooks
        if self.activation_bytes is None:  # the first pass: what its compute takes beyond the weights
            self._measure_from = self.peak_from_here()

    def _start_pass(self) -> None:
        self._starting = False
        # a module a pre-hook added is refused for this call; each block's tensors are checked as
        # it binds (_retake)
        with self.no_repack("a forward pre-hook of the model"):
            self._reconcile(())
        preloaded, self._preloaded = self._preloaded, []
        for j, versions in preloaded:  # loaded as the last pass ended: a weight written since is reloaded
            if self.ring.holds(j) and self.versions(j) != versions:
                self.ring.release(self.ring.slot_of(j))
        self._queue(0, self.num_slots)

    def _before_kept(self, following: int) -> None:
        """A kept block (on the device for good) is about to run; ``following``: the first streamed
        block after it. Its compute hides copies: the pass starts here if it has not, and the
        streamed blocks after it are queued as far as the ring allows (their slots' previous
        occupants ran already)."""
        if self._passes == 0 and self.ring is None:  # a kept block called on its own while the part is parked
            self._enter()
        if self._starting:
            self._start_pass()
        if self._passes > 0:
            self._queue(following, self.num_slots)

    def _end_pass(self, failed: bool) -> None:
        self._passes = max(self._passes - 1, 0)  # a _begin_pass interrupted before its count: not below 0
        # not enabled: a re-pack in this call failed, its RepackError says so; no ring: loading the part back
        # failed (out of memory), the next call tries again
        if self._passes or not self.enabled or self.ring is None:
            return
        self._starting = False
        try:
            if failed:
                self._abort_pass()
            self.transport.finish(failed)
        finally:
            # after a forward that saved weights, a backward comes: it starts with the blocks still in
            # their slots (they cannot change since without their versions showing it, which it checks)
            backward = not failed and self.saved.recorded
            self.quiesce(forget=not backward)
        if not failed and self.activation_bytes is None:
            # the peak since the pass began, which held the weights already
            self.activation_bytes = max(self.backend.max_memory_allocated() - self._measure_from, 0)
        if not failed and not backward and self._frozen:
            self._load_first()

    def _abort_pass(self) -> None:
        """This rank's forward failed before its end: load the blocks the transport says the
        other ranks still load in this pass (the sharded transport's gathers, flagged aborted)."""
        for i in self.transport.abort_pass():
            with self.transport.aborted(i):
                self.load(i)

    def _load_first(self) -> None:
        """Queue the first blocks of the next pass now, so that their copies overlap what runs
        between two forwards; only inside ``handle.frozen()``, where weights do not change through
        ``.data`` (their versions are noted, so that a write through a parameter is seen)."""
        first = range(min(self.num_slots, len(self.units)))
        self.transport.preloading(first)
        self._queue(0, self.num_slots)
        self._preloaded = [(j, self.versions(j)) for j in first]

    def _queue(self, first: int, count: int) -> None:
        """Load blocks ``first`` .. ``first + count - 1`` (those that exist) not in their slots yet;
        several under one stream context (``backend.batch``) unless the stager issues them (on its
        own thread) or a slot must be renewed first (an allocation, which must not happen inside)."""
        ring = self.ring
        todo = [j for j in range(first, min(first + count, len(self.units))) if not ring.holds(j)]
        if len(todo) > 1 and self.placement.stager is None and all(ring.at_rest(ring.slot_of(j)) for j in todo):
            with self.backend.batch(self.copy_stream):
                for j in todo:
                    self.load(j)
            return
        for j in todo:
            self.load(j)

    def freeze(self) -> None:
        locked(self.lock, self._count_freeze, 1)

    def thaw(self) -> None:
        locked(self.lock, self._count_freeze, -1)

    def _count_freeze(self, step: int) -> None:
        self._frozen += step
        if not self._frozen and self.enabled and self._passes == 0:
            # sharded, the preloaded blocks stay: their gathers were paired with the other ranks'
            # next loads (and the homes are shards no one else writes)
            self.quiesce(forget=not self.transport.sharded)

    def _repair(self, passes: int) -> None:
        """The state of ``passes`` model calls in progress (those still on the stack): what an
        interrupt left of a block or pass that is no longer running (its end never ran, or ran
        half-way) is undone, so that the next call works."""
        if self._passes <= passes and (self._bound < 0 or calls_running([self.blocks[self._bound]])):
            return
        logger.info("%s: undoing what an interrupted call left behind", self.describe())
        self.saved.end_block()
        if self._bound >= 0:
            self.ring.free_all(self.backend.current_stream())  # its end never marked its slot free
            bound, self._bound = self._bound, -1
            record = self.records[bound]
            if record.binding.to_home(record.write_back):
                self.dirty = True
        if passes == 0:
            self._passes, self._starting = 0, False
            self.quiesce()

    def _before_block(self, i: int) -> None:
        if self._bound >= 0 and self._passes == 0:  # a block call an interrupt tore, outside any pass
            self._repair(0)
        if self._passes == 0 and self.ring is None:  # called on its own while the part is parked
            self._enter()
        if self._bound >= 0:
            raise RuntimeError(
                f"block {self.block_names[i]} was called inside the forward of block "
                f"{self.block_names[self._bound]}; offloaded blocks must not call one another"
            )
        if self._starting:
            self._start_pass()
        in_pass = self._passes > 0
        # a block run again inside a backward (a checkpoint's recompute) is checked as in a pass: a
        # re-pack there would lay out anew the slots whose references the backward still reads
        checked_at_bind = in_pass or backward_running()
        if not checked_at_bind:
            self._reconcile([i])
        if not self.ring.holds(i):
            logger.debug("block %s called out of order: loading it synchronously", self.block_names[i])
            self._count_miss(i)
            self.load(i)
        if in_pass:
            self._queue(i + 1, self.depth)
        self.wait_ready(i)
        if checked_at_bind:
            self._retake(i)
        self._bound = i
        self.records[i].binding.to_device()
        if torch.is_grad_enabled():
            self._hook_gradients(i)
            self.saved.begin_block()

    def wait_ready(self, i: int, reader=None) -> None:
        """Make compute (a trace records the wait), or the stream ``reader``, wait until block
        ``i`` is in its slot."""
        record = self.records[i]
        if record.ticket is not None:
            ticket, record.ticket = record.ticket, None
            self.placement.wait(ticket)
        if reader is not None:  # not compute: the distributed read-back at disable
            record.ready.wait(reader)
            return
        stream = self.backend.current_stream()
        with UNTRACED if self.timeline is None else self.timeline.compute_after(stream, self._span_name(i)):
            record.ready.wait(stream)

    def _count_miss(self, i: int) -> None:
        """Block ``i`` is needed now and no prefetch brought it: its load cannot overlap."""
        self.counters.prefetch_misses += 1
        if self.timeline is not None:
            self.timeline.prefetch_miss(self._span_name(i))

    def _span_name(self, i: int) -> str:
        return f"{self.label}.{self.block_names[i]}"

    def _after_block(self, i: int, failed: bool) -> None:
        self.saved.end_block()
        if self._bound != i:
            return  # _before_block stopped before binding
        record, alone = self.records[i], self._passes == 0
        try:
            self.ring.mark_free(record.slot, self.backend.current_stream())
            if self.timeline is not None:
                self.timeline.end_compute(self.backend.current_stream())
            self._bound = -1
            if record.binding.to_home(record.write_back):
                self.dirty = True  # a tensor of another layout was kept (Binding.to_home): re-pack next pass
            if alone:
                self.quiesce()
        finally:
            if alone:
                self.transport.finish(failed)

    # -- autograd (see autograd.py: what it reads of the part is its ``StreamedPart``) ----------
    @property
    def epoch(self) -> int | None:
        """The enable whose slots autograd's references may read: None while disabled."""
        return self._enables if self.enabled else None

    def block_label(self, i: int) -> str:
        return f"block {self.block_names[i]} of {self.describe()}"

    def substituted(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a parameter the running block binds to a device copy of data given it
        (``_substitute``): it goes home to that data when the block ends, before a backward reads it."""
        binding = self.records[self._bound].binding if self._bound >= 0 else None
        return binding is not None and binding.base is not None and any(p is t for p in binding.params)

    def load_for_backward(self, i: int, miss: bool) -> None:
        """Block ``i`` in its slot for its backward: unless it is there, loaded once the backward
        issued so far (which read the slot's last block) is done."""
        ring = self.ring
        if ring is not None and ring.holds(i):
            return
        ring.mark_free(ring.slot_of(i), self.backend.current_stream())
        if miss:
            self._count_miss(i)
        self.load(i)

    def versions(self, i: int) -> tuple[int, ...]:
        return self.records[i].binding.versions()

    def end_backward(self) -> None:
        """The backward is over: check its end as a pass's (the sharded transport's headers), wait
        for its copies (an optimizer step may write the host weights next) and forget what the
        slots hold; a slot is refilled only after the backward compute that read it."""
        try:
            self.transport.finish(False)
        finally:
            self.ring.free_all(self.backend.current_stream())
            self.saved.recorded = False
            self.quiesce()

    def _hook_gradients(self, i: int) -> None:
        """Gradients of block ``i``'s trainable weights accumulate beside their home, the truth
        an optimizer updates (see docs/layerwise.md, "Training and gradients")."""
        record = self.records[i]
        binding = record.binding
        for param, home in zip(binding.params, binding.params_home):
            if param.requires_grad and id(param) not in self._grad_hooks:
                hook = functools.partial(_to_home, record.ready, home.device) if self.units[i].host else functools.partial(
                    _raise, self.transport.untrainable(i))
                self._grad_hooks[id(param)] = param.register_hook(hook)


def _to_home(ready, device: torch.device, grad: torch.Tensor) -> torch.Tensor:
    """The gradient, on its parameter's home device. The host first waits for the block's
    latest load (``ready``): once the gradient is in, a hook may step the parameter's home (an
    optimizer in backward) while a copy for the backward still reads it. (Moving the gradient
    home from the device would wait for it too, through the compute that waited for the load; a
    gradient already on the home device would not.)"""
    ready.synchronize()
    return grad if grad.device == device else grad.to(device)


def _raise(error: Exception, *args) -> None:
    raise error


def _nothing(failed: bool) -> None:
    pass


def _slot_label(strategy: "weakref.ref[LayerwiseOffload]", slot: int) -> str:
    """What a slot holds, for error reports: evaluated only when a report is written."""
    self = strategy()
    if self is None or self.ring is None:
        return f"slot {slot} of a layerwise offload that was disabled"
    occupant = self.ring.occupant(slot)
    holding = f"block {self.block_names[occupant]}" if occupant >= 0 else "no block yet"
    return f"slot {slot} of {self.name} ({holding})"
