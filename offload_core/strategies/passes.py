"""The passes of a layerwise part: what runs around each model forward and each block's forward.

This is the hot path (two hooks per block, every step), and the protocol of layerwise.py's
docstring, pass by pass: a pass begins (re-pack, checks), starts at its first block (the first
loads queued), binds each block to its slot and sends it home after, and ends (the host waits for
its copies, or, inside ``handle.frozen()``, queues the next pass's first blocks). Its state (the
nesting depth, the bound block, the frozen count, the blocks preloaded) is its own, apart from the
part's lifecycle (enable, park, disable) and from its checks of the user's changes, so that each
can be read on its own. It holds its part weakly, as the loader does: no reference cycle.
"""

from __future__ import annotations

import functools
import logging
import weakref

import torch
from torch.nn.modules.module import _global_forward_pre_hooks as _global_pre_hooks

from .autograd import backward_running, refuse_function_transforms
from .calls import calls_running

logger = logging.getLogger(__name__)


class Passes:
    """The model and block hooks of one layerwise part, and the state they keep between calls."""

    def __init__(self, part, loader, checks) -> None:
        self.part = weakref.proxy(part)
        self.loader = loader
        self.checks = checks
        self.saved = part.saved
        self.backend = part.backend
        self.pairing = part.transport.pairing  # None: its loads pair with no other rank's
        self.home_policy = part.home_policy
        self.running = 0  # nesting depth of model forwards
        self.starting = False  # a pass began and its first block has not been reached yet
        self.frozen = 0  # inside handle.frozen(): the next pass's first blocks load as a pass ends
        self.preloaded: list[tuple[int, tuple[int, ...]]] = []  # (block, its versions) loaded as a pass ended
        self.bound = -1  # the block whose tensors show its slot
        self.grad_hooks: dict[int, object] = {}  # id(parameter) -> its gradient hook
        self.measure_from = 0  # device memory allocated when the first pass began

    def instrument(self) -> None:
        """Wrap the streamed blocks, the kept ones and the model (the part's hooks) with the passes' hooks."""
        part = self.part
        for i, block in enumerate(part.blocks):
            part._wrap(block, functools.partial(self.before_block, i), functools.partial(self.after_block, i))
        kept = set(part.kept_names)
        following = 0  # streamed blocks before each kept one
        for name in part.all_names:
            if name in kept:
                block = part.model.get_submodule(name)
                part._wrap(block, functools.partial(self.before_kept, following), _nothing)
            else:
                following += 1
        part._wrap(part.model, self.begin, self.end, self.backend.device())
        part._hooks.extend(self.home_policy.instrument())

    def begin(self) -> None:
        part = self.part
        refuse_function_transforms(part.describe())
        if self.running or self.bound >= 0:  # rare: a nested pass, or one an interrupt tore
            self.repair(calls_running([part.model]) - 1)
        if part._relayout is not None and not self.running:
            part._apply_layout()
        self.running += 1
        if self.running > 1:
            return
        if part.switch is not None or self.loader.ring is None:
            self.enter()
        if self.saved.forget_backward():  # one that failed never reached its end
            self.end_backward()
        if self.saved.recorded:  # the slots kept for a backward are not trusted by a forward
            self.saved.recorded = False
            self.loader.quiesce()
        self.checks.reconcile(range(len(part.units)), before_pass=True)
        if self.preloaded and (part.model._forward_pre_hooks or _global_pre_hooks):
            # its pre-hooks may write the preloaded blocks' host weights: not while a copy reads them
            self.loader.quiesce(forget=False)
        self.starting = True  # loads start at the first block: after the model's own pre-hooks
        if part.activation_bytes is None:  # the first pass: what its compute takes beyond the weights
            self.measure_from = part.peak_from_here()

    def enter(self) -> None:
        """Before the part runs (a pass, or a block called on its own): when it is parked, the
        phase switch parks whoever the plan gives up for it, then the part loads itself back."""
        part = self.part
        if part.switch is not None:
            part.switch.entering(part.label)
        if self.loader.ring is None:
            part.unpark()
            if part.switch is not None:
                part.switch.loaded_back(part.label)

    def start(self) -> None:
        part, ring = self.part, self.loader.ring
        self.starting = False
        # a module a pre-hook added is refused for this call; each block's tensors are checked as
        # it binds (Checks.retake)
        with part.no_repack("a forward pre-hook of the model"):
            self.checks.reconcile(())
        preloaded, self.preloaded = self.preloaded, []
        for j, versions in preloaded:  # loaded as the last pass ended: a weight written since is reloaded
            if ring.holds(j) and self.loader.versions(j) != versions:
                ring.release(ring.slot_of(j))
        self.loader.queue(0, part.num_slots)

    def before_kept(self, following: int) -> None:
        """A kept block (on the device for good) is about to run; ``following``: the first streamed
        block after it. Its compute hides copies: the pass starts here if it has not, and the
        streamed blocks after it are queued as far as the ring allows (their slots' previous
        occupants ran already)."""
        if self.running == 0 and self.loader.ring is None:  # a kept block called on its own while the part is parked
            self.enter()
        if self.starting:
            self.start()
        if self.running > 0:
            self.loader.queue(following, self.part.num_slots)

    def end(self, failed: bool) -> None:
        self.running = max(self.running - 1, 0)  # a begin interrupted before its count: not below 0
        part = self.part
        # not enabled: a re-pack in this call failed, its RepackError says so; no ring: loading the part back
        # failed (out of memory), the next call tries again
        if self.running or not part.enabled or self.loader.ring is None:
            return
        self.starting = False
        try:
            if self.pairing is not None:  # a failed rank still loads what the others load in this pass
                self.pairing.end_pass(failed, self.loader.load)
        finally:
            # after a forward that saved weights, a backward comes: it starts with the blocks still in
            # their slots (they cannot change since without their versions showing it, which it checks)
            backward = not failed and self.saved.recorded
            self.loader.quiesce(forget=not backward)
        if not failed and part.activation_bytes is None:
            # the peak since the pass began, which held the weights already
            part.activation_bytes = max(self.backend.max_memory_allocated() - self.measure_from, 0)
        if not failed and not backward and self.frozen:
            part._load_first()

    def load_first(self) -> None:
        """Queue the first blocks of the next pass now, so that their copies overlap what runs
        between two forwards; only inside ``handle.frozen()``, where weights do not change through
        ``.data`` (their versions are noted, so that a write through a parameter is seen)."""
        part, loader = self.part, self.loader
        first = range(min(part.num_slots, len(part.units)))
        if self.pairing is not None:
            self.pairing.preloading(first)
        loader.queue(0, part.num_slots)
        self.preloaded = [(j, loader.versions(j)) for j in first]

    def count_freeze(self, step: int) -> None:
        self.frozen += step
        if not self.frozen and self.part.enabled and self.running == 0:
            # sharded, the preloaded blocks stay: their gathers were paired with the other ranks'
            # next loads (and the homes are shards no one else writes)
            self.loader.quiesce(forget=self.pairing is None)

    def repair(self, passes: int) -> None:
        """The state of ``passes`` model calls in progress (those still on the stack): what an
        interrupt left of a block or pass that is no longer running (its end never ran, or ran
        half-way) is undone, so that the next call works."""
        part = self.part
        if self.running <= passes and (self.bound < 0 or calls_running([part.blocks[self.bound]])):
            return
        logger.info("%s: undoing what an interrupted call left behind", part.describe())
        self.saved.end_block()
        if self.bound >= 0:
            self.loader.ring.free_all(self.backend.current_stream())  # its end never marked its slot free
            bound, self.bound = self.bound, -1
            record = self.loader.records[bound]
            if record.binding.to_home(record.write_back):
                part.dirty = True
        if passes == 0:
            self.running, self.starting = 0, False
            self.loader.quiesce()

    def before_block(self, i: int) -> None:
        part, loader = self.part, self.loader
        if self.bound >= 0 and self.running == 0:  # a block call an interrupt tore, outside any pass
            self.repair(0)
        if self.running == 0 and loader.ring is None:  # called on its own while the part is parked
            self.enter()
        if self.bound >= 0:
            raise RuntimeError(
                f"block {part.block_names[i]} was called inside the forward of block "
                f"{part.block_names[self.bound]}; offloaded blocks must not call one another"
            )
        if self.starting:
            self.start()
        in_pass = self.running > 0
        # a block run again inside a backward (a checkpoint's recompute) is checked as in a pass: a
        # re-pack there would lay out anew the slots whose references the backward still reads
        checked_at_bind = in_pass or backward_running()
        if not checked_at_bind:
            self.checks.reconcile([i])
        if not loader.ring.holds(i):
            logger.debug("block %s called out of order: loading it synchronously", part.block_names[i])
            loader.count_miss(i)
            loader.load(i)
        if in_pass:
            loader.queue(i + 1, part.depth)
        part.wait_ready(i)
        if checked_at_bind:
            self.checks.retake(i)
        self.bound = i
        loader.records[i].binding.to_device()
        if torch.is_grad_enabled():
            self.hook_gradients(i)
            self.saved.begin_block()

    def after_block(self, i: int, failed: bool) -> None:
        self.saved.end_block()
        if self.bound != i:
            return  # before_block stopped before binding
        loader = self.loader
        record, alone = loader.records[i], self.running == 0
        try:
            loader.ring.mark_free(record.slot, self.backend.current_stream())
            timeline = self.part.timeline
            if timeline is not None:
                timeline.end_compute(self.backend.current_stream())
            self.bound = -1
            if record.binding.to_home(record.write_back):
                self.part.dirty = True  # a tensor of another layout was kept (Binding.to_home): re-pack next pass
            if alone:
                loader.quiesce()
        finally:
            if alone and self.pairing is not None:
                self.pairing.end_pass(failed)

    def end_backward(self) -> None:
        """The backward is over: check its end as a pass's (the sharded transport's headers), wait
        for its copies (an optimizer step may write the host weights next) and forget what the
        slots hold; a slot is refilled only after the backward compute that read it."""
        try:
            if self.pairing is not None:
                self.pairing.end_pass(False)
        finally:
            self.loader.ring.free_all(self.backend.current_stream())
            self.saved.recorded = False
            self.loader.quiesce()

    def hook_gradients(self, i: int) -> None:
        """Gradients of block ``i``'s trainable weights accumulate beside their home, the truth
        an optimizer updates (see docs/layerwise.md, "Training and gradients")."""
        record = self.loader.records[i]
        binding = record.binding
        for param, home in zip(binding.params, binding.params_home):
            if param.requires_grad and id(param) not in self.grad_hooks:
                hook = (functools.partial(_to_home, record.ready, home.device) if self.part.units[i].host
                        else functools.partial(_raise, self.home_policy.untrainable(i)))
                self.grad_hooks[id(param)] = param.register_hook(hook)

    def substituted(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a parameter the running block binds to a device copy of data given it
        (``Checks.substitute``): it goes home to that data when the block ends, before a backward reads it."""
        binding = self.loader.records[self.bound].binding if self.bound >= 0 else None
        return binding is not None and binding.base is not None and any(p is t for p in binding.params)

    def drop_gradient_hooks(self) -> None:
        while self.grad_hooks:
            self.grad_hooks.popitem()[1].remove()


def _to_home(ready, device: torch.device, grad: torch.Tensor) -> torch.Tensor:
    """The gradient, on its parameter's home device. The host first waits for the block's
    latest load (``ready``): once the gradient is in, a hook may step the parameter's home (an
    optimizer in backward) while a copy for the backward still reads it. (Moving the gradient
    home from the device would wait for it too, through the compute that waited for the load; a
    gradient already on the home device would not.)"""
    ready.synchronize()
    return grad if grad.device == device else grad.to(device)


def _nothing(failed: bool) -> None:
    pass


def _raise(error: Exception, *args) -> None:
    raise error
