"""Layerwise offloading: blocks stream through a fixed ring of device slots.

A block's tensors show its device slot only while the block's own forward runs; before and
after, they show the block's host buffer, the truth. So whatever the user does between forwards
(``load_state_dict``, in-place edits, LoRA fusing, reading a weight, calling a child module from
elsewhere) reads and writes the truth, and a copy never computes on another block's weights.

A model forward is one *pass*. It starts by checking that every block still shows its own host
buffer (a parameter given new data of the same shape is copied into it; anything else is a
structural change and the model is re-packed); when its first block is reached (after the
model's own pre-hooks, which may have edited weights) it checks again and queues blocks
``0 .. prefetch_depth`` into their slots. Before block ``i`` runs, its wrapper makes sure ``i`` is the occupant of its slot
(else loads it synchronously and counts a miss), queues the next ``prefetch_depth`` blocks, makes
the compute stream wait for ``i``'s ready event and binds ``i`` to its slot; after it, the slot is
marked free with an event on the compute stream, changes the forward made to the block's tensors
are copied home, and ``i`` is bound to its host buffer again. A copy into a slot always waits for
the slot's free event. When the pass ends the host waits for the last queued copy, so host memory
is never written while a copy still reads it, and nothing stays in a slot across passes: a block is
loaded afresh in every pass, from the host as it is then. (A pass that saved weights for a backward
leaves its last blocks in their slots for it; see autograd.py.)

A block called outside a model forward is loaded synchronously (a miss) and dropped after.

Inside ``handle.frozen()`` (every pipeline call without step callbacks is), the user promises not
to change weights between forwards: the end of a pass then queues the first blocks of the next, so
that their copies overlap whatever runs between two forwards (a scheduler step, the embeddings). A
change the handle can see (a parameter given new data, a buffer replaced, a module added, a dtype
change) still drops those copies and loads afresh; an in-place write through ``.data`` it cannot
see, which is what the promise is about.

A model with one block gets one slot: nothing can be copied while the block computes, so its copy
at the start of each forward cannot overlap (the enable log says so).

Blocks whose home is not pinned (a ``pinned_memory`` budget, or on disk with ``host_memory``) are
loaded by the placement's stager thread through its bounce ring: ``_load`` then hands the whole
load (slot wait, copies, ready event) to the stager, and the block's ticket is waited before
compute waits on its ready event. A block whose home is on disk has no host memory to show
outside its forward: its tensors are placeholders then (see :func:`placeholders`); its state dict
is read from disk, and writing into it is refused.
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
from ..hostmem.placement import ONCE, STREAM, HostUnit
from ..timeline import UNTRACED
from ..weights import nbytes_of, slot_numel, split_units
from ..weights.binding import Binding
from .autograd import SavedSlots
from .common import Transaction, allocate_device, copy_unit, default_placement, pack_units, unpack_units
from .part import Part, adopt_foreign, blocks_now, write_back

logger = logging.getLogger(__name__)


class LayerwiseOffload(Part):
    """Streams the blocks of one model; everything outside the blocks stays resident."""

    strategy = "layerwise"

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
        super().__init__(backend)
        self.model = model
        self.label = type(model).__name__  # names timeline spans: "<label>.<block name>"
        self.block_names = [name for name, _ in blocks]
        self.prefetch_depth = prefetch_depth
        self._passes = 0  # nesting depth of model forwards
        self._starting = False  # a pass began and its first block has not been reached yet
        self._frozen = 0  # inside handle.frozen(): the next pass's first blocks load as a pass ends
        self._bound = -1  # the block whose tensors show its slot
        self._occupant: list[int] = []
        self._tickets: dict[int, object] = {}  # block -> stager ticket of its pending load
        self._slot_uses: list[list[tuple[object, int]]] = []  # per slot: (storage, its use count at rest)
        self._grad_hooks: dict[int, object] = {}  # id(parameter) -> its gradient hook
        self.saved = SavedSlots(self)
        self.epoch = 0  # counts enables: autograd's references to slots are valid within one
        self._plan([block for _, block in blocks])

    def _plan(self, blocks: list[nn.Module]) -> None:
        self.blocks = blocks
        self.depth = min(self.prefetch_depth, len(blocks) - 1)
        self.resident, self.units = split_units(self.model, list(zip(self.block_names, blocks)))
        self.num_slots = self.depth + 1
        self.slot_shape = slot_numel(self.units)

    def _replan(self) -> None:
        found = blocks_now(self.model, self.block_names)  # by name, or found again after a shortened list
        self.block_names = [name for name, _ in found]
        self._plan([block for _, block in found])

    def host_units(self) -> list:
        """The units whose homes the placement policy decides: blocks are streamed every step."""
        return [HostUnit(self.resident, ONCE, self.resident.nbytes),
                *(HostUnit(u, STREAM, u.nbytes) for u in self.units)]

    def describe(self) -> str:
        return type(self.model).__name__

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
        self._queued = False  # copies were queued since the host last waited for the copy stream
        self._stager = self.placement.stager
        self.placement.wait(copy_unit(self.resident, resident_device, self.placement, self.copy_stream, self.counters))
        done = backend.new_event()
        done.record(self.copy_stream)
        done.synchronize()
        self.resident_device = resident_device
        self.resident_views = self.resident.region_views(resident_device)
        self.resident.bind(self.resident_views)
        txn.on_rollback(lambda: self.resident.bind(self.resident.host_views))
        self._show_placeholders()
        self.epoch += 1
        self._bind_slots()
        # the ring's own references to each slot, counted at rest: more, later, means that
        # something outside the ring still holds the slot (see _check_slot)
        self._slot_uses = [self._uses(s) for s in range(self.num_slots)]
        self._instrument()
        txn.on_rollback(self._remove_hooks)
        self.enabled = True
        txn.on_rollback(lambda: setattr(self, "enabled", False))
        logger.info(
            "%s offload of %s: %d blocks, %d slots of %.1f MB, %.1f MB resident%s",
            self.strategy, type(self.model).__name__, len(self.units), self.num_slots, self.slot_bytes / 2**20,
            self.resident_bytes / 2**20,
            "; one block in one slot: its copy cannot overlap compute" if len(self.units) == 1 else "",
        )

    def _bind_slots(self) -> None:
        """Plan every block's transfers into its slot and its binding to the slot's views."""
        self._plan_transfers()
        self._bindings = [
            Binding(unit, self._home_views(i), unit.views(self.slots[i % self.num_slots]))
            for i, unit in enumerate(self.units)
        ]
        self.saved.index(self.slots)

    def _show_placeholders(self) -> None:
        """Blocks with no home in RAM (on disk) show placeholders outside their forward."""
        for unit in self.units:
            if unit.image is not None:
                unit.host_views = placeholders(unit)
                unit.bind(unit.host_views)

    def _instrument(self) -> None:
        for i, block in enumerate(self.blocks):
            self._wrap(block, functools.partial(self._before_block, i), functools.partial(self._after_block, i))
            if self.units[i].image is not None:  # its home is on disk: its state dict is read from there
                pre, post = self._state_from_disk(i)
                self._hooks.append(block.register_state_dict_pre_hook(pre))
                self._hooks.append(block.register_state_dict_post_hook(post))
                self._refuse_writes(i, block)
        self._wrap(self.model, self._begin_pass, self._end_pass, self.backend.device())

    def _refuse_writes(self, i: int, block: nn.Module) -> None:
        refuse = functools.partial(_refuse_loading, f"block {self.block_names[i]} of {self.describe()}", "disk")
        for module in block.modules():
            self._hooks.append(module.register_load_state_dict_pre_hook(refuse))

    def _state_from_disk(self, i: int):
        """State dict hooks for block ``i``, whose home is on disk: the block shows its values read
        from there while its state dict is taken (so that modules with their own
        ``_save_to_state_dict``, optimum-quanto's, read them too), its placeholders again after."""
        unit = self.units[i]

        def pre(module: nn.Module, prefix: str, keep_vars: bool) -> None:
            unit.bind(unit.views(unit.home()))

        def post(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
            unit.bind(unit.host_views)

        return pre, post

    def _home_views(self, i: int) -> list:
        """What block ``i``'s tensors show outside its forward: its host buffer, or placeholders."""
        return self.units[i].host_views

    def truth(self) -> list:
        return self.truth_buffers()

    def truth_buffers(self) -> list:
        """(unit, views its owners show, buffers holding its true values) per unit (read from
        disk for a home there)."""
        found = [(u, self._home_views(i), u.home()) for i, u in enumerate(self.units) if u.host or u.image]
        return [(self.resident, self.resident_views, self.resident_device), *found]

    def _new_copy_stream(self):
        return self.backend.new_stream()

    def _allocate_device(self) -> None:
        self.slots = [self._new_slot(s) for s in range(self.num_slots)]

    def _new_slot(self, s: int) -> dict:
        # the label holds the strategy weakly: a global label table must not keep a model alive
        return allocate_device(self.backend, self.slot_shape, functools.partial(_slot_label, weakref.ref(self), s))

    def _check_slot(self, slot: int) -> None:
        """Before a slot is refilled: if something outside the ring still references its memory
        (a weight view a hook kept, a block output that views a weight, a tensor autograd saved
        outside a block), that memory is given to its holder and the slot gets new memory, so
        the holder keeps reading the weights it took, never the next block's."""
        if self._at_rest(slot):
            return
        self.copy_stream.synchronize()  # a finished transfer (a collective's work) may still hold views
        if self._at_rest(slot):
            return
        occupant = self._occupant[slot]
        holding = f"block {self.block_names[occupant]}" if occupant >= 0 else "no block"
        try:
            replacement = self._new_slot(slot)
        except torch.OutOfMemoryError as exc:
            raise OffloadedModelError(
                f"a tensor viewing the device weights of {holding} of {self.describe()} is still referenced "
                "after its forward (a kept .detach() or view of a weight, or an output that views one), and "
                f"there is no device memory for a new slot ({exc}). Keep a .clone() instead of a view, or "
                "drop the reference before the next blocks run"
            ) from exc
        logger.warning(
            "%s: memory of slot %d (%s) is still referenced outside its block; it stays with its holder "
            "and the slot gets %.1f MB of new device memory", self.describe(), slot, holding, self.slot_bytes / 2**20,
        )
        self.counters.retired_slot_bytes += self.slot_bytes
        # the new memory may have been freed by compute still queued: copy into it after that
        self.backend.wait_stream(self.copy_stream, self.backend.current_stream())
        self.slots[slot] = replacement
        self._bind_slots()
        self._slot_uses[slot] = self._uses(slot)

    def _uses(self, slot: int) -> list[tuple[object, int]]:
        """Each storage of a slot with its use count now, when only the ring references it."""
        storages = [b.untyped_storage() for b in self.slots[slot].values() if b.numel()]
        return [(storage, _use_count(storage)) for storage in storages]

    def _at_rest(self, slot: int) -> bool:
        return all(_use_count(storage) == uses for storage, uses in self._slot_uses[slot])

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
        """Wait for queued copies, give every tensor back an ordinary host copy (changes made on
        the device to resident tensors included), free the device. Can be called again after an
        interruption, and does nothing once done."""
        with self.lock:
            self._remove_hooks()
            if not self.enabled:
                return
            self._quiesce()
            # what references the homes goes first, so that each is released once its unit is unpacked
            self._transfers = self._images = self._bindings = []
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
        self.slots = []
        self._transfers = self._images = []
        self._tickets = {}
        self._bindings = []
        self._occupant = []
        self._slot_uses = []
        while self._grad_hooks:
            self._grad_hooks.popitem()[1].remove()
        self.saved.index([])
        self.resident_device = {}
        self.resident_views = []
        self._queued = False

    def _quiesce(self, forget: bool = True) -> None:
        """Wait until no queued copy reads host memory any more; forget what the slots hold
        (unless ``forget`` is False: the slots keep blocks a backward will read)."""
        if self._queued:  # the whole stream: a load interrupted half-way recorded no event
            self.placement.drain()  # loads handed to the stager are on the stream first
            self.copy_stream.synchronize()
            self._queued = False
            self._tickets = {}
        if forget:
            self._occupant = [-1] * self.num_slots

    # -- keeping the model and its packing in step ------------------------------------------
    def _reconcile(self, blocks) -> None:
        """Before a pass: every block must still show its host views. A parameter given new data
        of the same shape and dtype (``p.data = t``) has it copied home; a buffer replaced the
        same way too; any other change, or a module or tensor added (``dirty``), re-packs."""
        structural = self.dirty
        for i in blocks:
            if self.units[i].image is not None:
                check_placeholders(self.units[i].host_views, f"block {self.block_names[i]} of {self.describe()}")
            if not self._bindings[i].at_home():
                if not self.units[i].host:
                    raise self._no_ram_home(i)
                self._quiesce()  # copies queued earlier read the host as it was
                structural |= adopt_foreign(self.backend, self.units[i], self._home_views(i))
        if structural:
            logger.info("the structure of %s changed while offloaded: packing it again", self.describe())
            self.dirty = False
            self.repack()

    def _no_ram_home(self, i: int) -> Exception:
        """The error for a change to block ``i``, which has no home in RAM to take it."""
        return OffloadedModelError(
            f"block {self.block_names[i]} of {self.describe()} has its home on disk (a host_memory budget): "
            "it has no host copy to change. Call handle.disable() first, or give it RAM"
        )

    # -- streaming ------------------------------------------------------------------------
    def _load(self, i: int) -> None:
        """Queue block ``i``'s transfers into its slot once the slot's last reader is done."""
        slot = i % self.num_slots
        self._check_slot(slot)
        self._occupant[slot] = -1  # an interrupted load leaves the slot empty, not stale
        self._queued = True
        if self._stager is None:
            self._queue_load(i, slot)
        else:
            image = self._images[i]
            if image is not None:  # on disk: the kernel reads ahead while earlier loads are staged
                image.advise()
            # The stager waits on freed[slot] later: safe, because freed[slot] is recorded again
            # only after block i has run, and block i runs only after this load's ticket.
            self._tickets[i] = self._stager.submit(functools.partial(self._queue_load, i, slot))
        self._occupant[slot] = i
        counters = self.counters
        counters.loads += 1
        counters.h2d_copies += self._transfer_copies[i]
        counters.h2d_bytes += self._transfer_bytes[i]

    def _queue_load(self, i: int, slot: int) -> None:
        stream = self.copy_stream
        self.freed[slot].wait(stream)
        try:
            if self.timeline is None:
                self._issue(i, stream)
            else:
                issue = functools.partial(self._issue, i, stream)
                self.timeline.copy(stream, self._span_name(i), self._transfer_bytes[i], issue)
        finally:  # also after a failure half-way: what waits for block i waits for what was queued
            self.ready[i].record(stream)

    def _begin_pass(self) -> None:
        self._passes += 1
        if self._passes > 1:
            return
        if self.saved.forget_backward():  # one that failed never reached its end
            self.end_backward()
        if self.saved.recorded:  # the slots kept for a backward are not trusted by a forward
            self.saved.recorded = False
            self._quiesce()
        self._reconcile(range(len(self.units)))
        self._starting = True  # loads start at the first block: after the model's own pre-hooks

    def _start_pass(self) -> None:
        self._starting = False
        with self.no_repack("a forward pre-hook of the model"):  # this call's blocks are bound already
            self._reconcile(range(len(self.units)))
        for j in range(self.num_slots):
            if self._occupant[j] != j:
                self._load(j)

    def _end_pass(self, failed: bool) -> None:
        self._passes -= 1
        if self._passes:
            return
        self._starting = False
        # after a forward that saved weights, a backward comes: it starts with the blocks still in
        # their slots (they cannot change since without their versions showing it, which it checks)
        backward = not failed and self.saved.recorded
        self._quiesce(forget=not backward)
        if not failed and not backward and self._frozen:
            self._load_first()

    def _load_first(self) -> None:
        """Queue the first blocks of the next pass now, so that their copies overlap what runs
        between two forwards; only inside ``handle.frozen()``, where weights do not change."""
        for j in range(self.num_slots):
            self._load(j)

    def freeze(self) -> None:
        with self.lock:
            self._frozen += 1

    def thaw(self) -> None:
        with self.lock:
            self._frozen -= 1
            if not self._frozen and self.enabled and self._passes == 0:
                self._quiesce()

    def _before_block(self, i: int) -> None:
        if self._bound >= 0:
            raise RuntimeError(
                f"block {self.block_names[i]} was called inside the forward of block "
                f"{self.block_names[self._bound]}; offloaded blocks must not call one another"
            )
        if self._starting:
            self._start_pass()
        in_pass = self._passes > 0
        if not in_pass:
            self._reconcile([i])
        if self._occupant[i % self.num_slots] != i:
            logger.debug("block %s called out of order: loading it synchronously", self.block_names[i])
            self._count_miss(i)
            self._load(i)
        if in_pass:
            for j in range(i + 1, min(i + 1 + self.depth, len(self.units))):
                if self._occupant[j % self.num_slots] != j:
                    self._load(j)
        self.wait_ready(i)
        self._bound = i
        self._bindings[i].to_device()
        if torch.is_grad_enabled():
            self._hook_gradients(i)
            self.saved.begin_block()

    def wait_ready(self, i: int, reader=None) -> None:
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
        self.freed[i % self.num_slots].record(self.backend.current_stream())
        if self.timeline is not None:
            self.timeline.end_compute(self.backend.current_stream())
        self._bound = -1
        if self._bindings[i].to_home(self._write_back_block(i)):
            self.dirty = True  # a buffer was replaced by a tensor of another shape: re-pack next pass
        if self._passes == 0:
            self._quiesce()

    def _write_back_block(self, i: int):
        if not self.units[i].host:
            return functools.partial(_refuse_write_back, self._no_ram_home(i))
        return functools.partial(write_back, self.backend)


    # -- autograd (see autograd.py) ------------------------------------------------------------
    def occupant(self, slot: int) -> int:
        return self._occupant[slot]

    def load_for_backward(self, i: int, miss: bool) -> None:
        """Load block ``i`` for its backward, once the backward issued so far (which read the
        slot's last block) is done."""
        self.freed[i % self.num_slots].record(self.backend.current_stream())
        if miss:
            self._count_miss(i)
        self._load(i)

    def versions(self, i: int) -> tuple[int, ...]:
        return tuple(p._version for p in self._bindings[i].params)

    def end_backward(self) -> None:
        """The backward is over: wait for its copies (an optimizer step may write the host
        weights next) and forget what the slots hold; a slot is refilled only after the backward
        compute that read it."""
        stream = self.backend.current_stream()
        for freed in self.freed:
            freed.record(stream)
        self.saved.recorded = False
        self._quiesce()

    def _hook_gradients(self, i: int) -> None:
        """Gradients of block ``i``'s trainable weights accumulate beside their home, the truth
        an optimizer updates (see docs/layerwise.md, "Training and gradients")."""
        binding = self._bindings[i]
        for param, home in zip(binding.params, binding.params_home):
            if param.requires_grad and id(param) not in self._grad_hooks:
                hook = functools.partial(_to_home, home.device) if self.units[i].host else functools.partial(
                    _untrainable, self._untrainable(i))
                self._grad_hooks[id(param)] = param.register_hook(hook)

    def _untrainable(self, i: int) -> Exception:
        """The error for a gradient of block ``i``'s weights when they have no host copy to train."""
        return self._no_ram_home(i)


def _use_count(storage) -> int:
    return torch._C._storage_Use_Count(storage._cdata)


def _to_home(device: torch.device, grad: torch.Tensor) -> torch.Tensor:
    return grad if grad.device == device else grad.to(device)


def _untrainable(error: Exception, grad: torch.Tensor) -> torch.Tensor:
    raise error


def _slot_label(strategy: "weakref.ref[LayerwiseOffload]", slot: int) -> str:
    """What a slot holds, for error reports: evaluated only when a report is written."""
    self = strategy()
    if self is None:
        return f"slot {slot} of a layerwise offload that was disabled"
    occupant = self._occupant[slot] if slot < len(self._occupant) else -1
    holding = f"block {self.block_names[occupant]}" if occupant >= 0 else "no block yet"
    return f"slot {slot} of {self._name} ({holding})"


def placeholders(unit) -> list[torch.Tensor]:
    """What a block with no home in RAM (on disk, or a rank's shard) shows outside its forward:
    host tensors of the right shape and dtype, every element NaN (integers: their maximum,
    booleans: True) through one element of memory (all strides 0). Computing with them gives NaN
    on a CPU and a device-mismatch error on an accelerator, never another block's weights; writing
    into them raises (their elements overlap)."""
    poison = {}
    for dtype in unit.numel:
        if dtype.is_floating_point or dtype.is_complex:
            value = float("nan")
        elif dtype == torch.bool:
            value = True
        else:
            value = torch.iinfo(dtype).max
        poison[dtype] = torch.full((), value, dtype=dtype)
    return [poison[e.dtype].expand(e.size) for e in unit.entries]


def _refuse_loading(what: str, why: str, module: nn.Module, *args) -> None:
    raise OffloadedModelError(
        f"{what} has its home on {why} and no host copy to load a state dict into: call handle.disable() first"
    )


def _refuse_write_back(error: Exception, pairs) -> None:
    raise error
