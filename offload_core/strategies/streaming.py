"""The streaming protocol of a layerwise part: passes, blocks, loads, and the backward's reloads.

A model forward is one *pass*. It starts by checking that every block still shows its own host
buffer (a parameter given new data of the same shape is copied into it; anything else is a
structural change and the model is re-packed); when its first block is reached (after the
model's own pre-hooks, which may have edited weights) it checks again and queues blocks
``0 .. prefetch_depth`` into their slots. Before block ``i`` runs, its wrapper makes sure ``i``
is the occupant of its slot (else loads it synchronously and counts a miss), queues the next
``prefetch_depth`` blocks, makes the compute stream wait for ``i``'s ready event and binds ``i``
to its slot; after it, the slot is marked free with an event on the compute stream, changes the
forward made to the block's tensors are copied home, and ``i`` is bound to its host buffer again.
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
"""

from __future__ import annotations

import functools
import logging

import torch

from torch.nn.modules.module import _global_forward_pre_hooks as _global_pre_hooks

from ..timeline import UNTRACED
from .autograd import refuse_function_transforms
from .calls import calls_running
from .ring import BlockPlan, kept_views

logger = logging.getLogger(__name__)


class Streaming:
    """What a layerwise part does at each pass, block and load (mixed into ``LayerwiseOffload``,
    whose ``enable`` builds the ring, plans and transport used here)."""

    # -- streaming ------------------------------------------------------------------------
    def load(self, i: int) -> None:
        """Queue block ``i``'s transfers into its slot once the slot's last reader is done."""
        plan, ring = self.plans[i], self.ring
        slot = plan.slot
        if not ring.at_rest(slot):
            self._renew(slot)
            plan = self.plans[i]
        ring.occupant[slot] = -1  # an interrupted load leaves the slot empty, not stale
        self._queued = True
        stager = self.placement.stager
        if stager is None:
            self._queue_load(plan)
        else:
            # The stager waits on the slot's free event later: safe, because it is recorded again
            # only after block i has run, and block i runs only after this load's ticket.
            plan.ticket = stager.submit(functools.partial(self._stage_load, plan))
        ring.occupant[slot] = i
        counters = self.counters
        counters.loads += 1
        counters.h2d_copies += plan.copies
        counters.h2d_bytes += plan.nbytes

    def _renew(self, slot: int) -> None:
        """Something outside the ring still references ``slot``: leave it that memory, re-plan the
        slot's blocks onto the new memory the ring gives the slot."""
        occupant = self.ring.occupant[slot]
        holding = f"block {self.block_names[occupant]}" if occupant >= 0 else "no block"
        old = self.ring.slots[slot]
        if not self.ring.renew(slot, self.copy_stream, holding, self.describe()):
            return
        for where in kept_views(self.model, old):
            logger.warning(
                "%s: %s keeps a view of the device copy of offloaded weights across forwards: it reads the weights of "
                "the forward that made it, never later changes to them (also after disable()). Make it again in each "
                "forward, or keep a .clone()", self.describe(), where,
            )
        self.counters.retired_slot_bytes += self.ring.nbytes
        for plan in self.plans[slot :: self.num_slots]:
            self.plans[plan.index] = self._block_plan(plan.index, plan.ready, plan.ticket)
        self.saved.index(self.ring.slots)
        self.ring.settle(slot)

    def _stage_load(self, plan: BlockPlan) -> None:
        """A load on the stager thread: the blocks on disk after this one are read ahead while
        it is staged (see ``hostmem.staging.ReadAhead``)."""
        self.placement.staging_block(self.plans, plan.index)
        self._queue_load(plan)

    def _queue_load(self, plan: BlockPlan) -> None:
        stream = self.copy_stream
        self.ring.freed[plan.slot].wait(stream)
        try:
            if self.timeline is None:
                self.transport.issue(plan, stream)
            else:
                issue = functools.partial(self.transport.issue, plan, stream)
                self.timeline.copy(stream, self._span_name(plan.index), plan.nbytes, issue)
        finally:  # also after a failure half-way: what waits for block i waits for what was queued
            plan.ready.record(stream)

    def _begin_pass(self) -> None:
        refuse_function_transforms(self.describe())
        if self._passes or self._bound >= 0:  # rare: a nested pass, or one an interrupt tore
            self._repair(calls_running([self.model]) - 1)
        self._passes += 1
        if self._passes > 1:
            return
        if self.saved.forget_backward():  # one that failed never reached its end
            self.end_backward()
        if self.saved.recorded:  # the slots kept for a backward are not trusted by a forward
            self.saved.recorded = False
            self.quiesce()
        self._reconcile(range(len(self.units)))
        if self._preloaded and (self.model._forward_pre_hooks or _global_pre_hooks):
            # its pre-hooks may write the preloaded blocks' host weights: not while a copy reads them
            self.quiesce(forget=False)
        self._starting = True  # loads start at the first block: after the model's own pre-hooks
        if self.activation_bytes is None:  # the first pass: what its compute takes beyond the weights
            self._measure_from = self.backend.memory_allocated()

    def _start_pass(self) -> None:
        self._starting = False
        with self.no_repack("a forward pre-hook of the model"):  # this call's blocks are bound already
            self._reconcile(range(len(self.units)))
        preloaded, self._preloaded = self._preloaded, []
        for j, versions in preloaded:  # loaded as the last pass ended: a weight written since is reloaded
            if self.ring.occupant[j % self.num_slots] == j and self.versions(j) != versions:
                self.ring.occupant[j % self.num_slots] = -1
        self._queue(0, self.num_slots)

    def _before_kept(self, following: int) -> None:
        """A kept block (on the device for good) is about to run; ``following``: the first streamed
        block after it. Its compute hides copies: the pass starts here if it has not, and the
        streamed blocks after it are queued as far as the ring allows (their slots' previous
        occupants ran already)."""
        if self._starting:
            self._start_pass()
        if self._passes > 0:
            self._queue(following, self.num_slots)

    def _end_pass(self, failed: bool) -> None:
        self._passes = max(self._passes - 1, 0)  # a _begin_pass interrupted before its count: not below 0
        if self._passes or not self.enabled:  # not enabled: a re-pack in this call failed, its RepackError says so
            return
        self._starting = False
        try:
            if failed:
                self.transport.abort_pass()
            self.transport.finish(failed)
        finally:
            # after a forward that saved weights, a backward comes: it starts with the blocks still in
            # their slots (they cannot change since without their versions showing it, which it checks)
            backward = not failed and self.saved.recorded
            self.quiesce(forget=not backward)
        if not failed and self.activation_bytes is None:
            # an upper bound: the peak since enable counts, and it held the weights already
            self.activation_bytes = max(self.backend.max_memory_allocated() - self._measure_from, 0)
        if not failed and not backward and self._frozen:
            self._load_first()

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
        occupant, slots = self.ring.occupant, self.num_slots
        todo = [j for j in range(first, min(first + count, len(self.units))) if occupant[j % slots] != j]
        if len(todo) > 1 and self.placement.stager is None and all(self.ring.at_rest(j % slots) for j in todo):
            with self.backend.batch(self.copy_stream):
                for j in todo:
                    self.load(j)
            return
        for j in todo:
            self.load(j)

    def freeze(self) -> None:
        with self.lock:
            self._frozen += 1

    def thaw(self) -> None:
        with self.lock:
            self._frozen -= 1
            if not self._frozen and self.enabled and self._passes == 0:
                # sharded, the preloaded blocks stay: their gathers were paired with the other
                # ranks' next loads (and the homes are shards no one else writes)
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
            plan = self.plans[bound]
            if plan.binding.to_home(plan.write_back):
                self.dirty = True
        if passes == 0:
            self._passes, self._starting = 0, False
            self.quiesce()

    def _before_block(self, i: int) -> None:
        if self._bound >= 0 and self._passes == 0:  # a block call an interrupt tore, outside any pass
            self._repair(0)
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
        if self.ring.occupant[i % self.num_slots] != i:
            logger.debug("block %s called out of order: loading it synchronously", self.block_names[i])
            self._count_miss(i)
            self.load(i)
        if in_pass:
            self._queue(i + 1, self.depth)
        self.wait_ready(i)
        self._bound = i
        self.plans[i].binding.to_device()
        if torch.is_grad_enabled():
            self._hook_gradients(i)
            self.saved.begin_block()

    def wait_ready(self, i: int, reader=None) -> None:
        """Make compute (a trace records the wait), or the stream ``reader``, wait until block
        ``i`` is in its slot."""
        plan = self.plans[i]
        if plan.ticket is not None:
            ticket, plan.ticket = plan.ticket, None
            self.placement.wait(ticket)
        if reader is not None:  # not compute: the distributed read-back at disable
            plan.ready.wait(reader)
            return
        stream = self.backend.current_stream()
        with UNTRACED if self.timeline is None else self.timeline.compute_after(stream, self._span_name(i)):
            plan.ready.wait(stream)

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
        plan, alone = self.plans[i], self._passes == 0
        try:
            self.ring.freed[plan.slot].record(self.backend.current_stream())
            if self.timeline is not None:
                self.timeline.end_compute(self.backend.current_stream())
            self._bound = -1
            if plan.binding.to_home(plan.write_back):
                self.dirty = True  # a buffer was replaced by a tensor of another shape: re-pack next pass
            if alone:
                self.quiesce()
        finally:
            if alone:
                self.transport.finish(failed)

    # -- autograd (see autograd.py) ------------------------------------------------------------
    def occupant(self, slot: int) -> int:
        return self.ring.occupant[slot]

    def load_for_backward(self, i: int, miss: bool) -> None:
        """Load block ``i`` for its backward, once the backward issued so far (which read the
        slot's last block) is done."""
        self.ring.freed[i % self.num_slots].record(self.backend.current_stream())
        if miss:
            self._count_miss(i)
        self.load(i)

    def versions(self, i: int) -> tuple[int, ...]:
        return tuple(p._version for p in self.plans[i].binding.params)

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
        plan = self.plans[i]
        binding = plan.binding
        for param, home in zip(binding.params, binding.params_home):
            if param.requires_grad and id(param) not in self._grad_hooks:
                hook = functools.partial(_to_home, plan.ready, home.device) if self.units[i].host else functools.partial(
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
