"""Model-level offload: which component calls are running, and so when a group may leave the device.

A group stays active for a whole pipeline call (``begin_call``/``end_call``), else for its
component's outermost forward, or for a child called on its own (``vae.decode``). These counts
decide every "the group goes home now"; an interrupt can tear a call's end half-way, so the next
call checks them against the calls really on the stack and undoes what the torn one left (its
saved-tensor hooks, a count not taken back) before anything else. Kept apart from the swapping
itself (model_level.py), which only asks these counts whether a group is still in use.
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from .autograd import SavedParameters, refuse_function_transforms
from .calls import calls_running
from .part import Part

logger = logging.getLogger(__name__)


class ComponentCalls(Part):
    """The calls of a model-level part's components: wraps each component (and its children, which
    ``encode()``/``decode()`` call past the root) so that its group becomes active when it runs,
    counts the calls in progress, pushes the saved-tensor hooks of a recording forward, and sends
    the groups home once no call holds them. Mixed into ``ModelLevelOffload``, whose groups,
    swapping (``_before_use``, ``release_all``, ``_active``) and device copies
    (``_device_copies``, model_saved.py) it drives."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self._calls = 0  # pipeline calls in progress: groups stay on the device until they end
        self._depth = 0  # component forwards in progress
        self._saving: list = []  # per component forward in progress: its SavedParameters, if recording

    def _instrument(self) -> None:
        device = self.backend.device()
        for index, group in enumerate(self.groups):
            for c in group.components:
                self._wrap(c.module, functools.partial(self._enter, index), self._exit, device)
                for child in c.module.children():  # encode()/decode() bypass the root's call
                    self._hooks.append(child.register_forward_pre_hook(functools.partial(self._child_hook, index)))
                    self._hooks.append(child.register_forward_hook(self._child_done, always_call=True))

    def begin_call(self) -> None:
        """A pipeline call starts: groups stay on the device until it ends."""
        self._calls += 1

    def end_call(self) -> None:
        self._calls -= 1
        if self._calls == 0:
            self.release_all()

    def _enter(self, index: int) -> None:
        refuse_function_transforms(self.describe())
        if self._depth or self._saving:  # rare: a nested call, or what an interrupted one left
            self._repair(calls_running(self.modules()) - 1)
        self._depth += 1
        self._before_use(index)
        saving = None
        if torch.is_grad_enabled():
            components = self.groups[index].components
            saving = SavedParameters(self._device_copies(index), [c.binding for c in components])
        self._saving.append(saving)  # before its hooks are pushed: an interrupt then is undone by _exit
        if saving is not None:
            saving.__enter__()

    def _exit(self, failed: bool) -> None:
        self._depth = max(self._depth - 1, 0)  # an _enter interrupted before its count: not below 0
        if len(self._saving) > self._depth:  # entries are added once the group is on the device
            saving = self._saving[-1]
            if saving is not None:
                saving.__exit__(None, None, None)
            self._saving.pop()  # last: an exit interrupted before it is done again by the next call
        if self._depth == 0 and self._calls == 0:
            self.release_all()

    def _repair(self, depth: int) -> None:
        """``depth`` component calls are running (on the stack): an interrupt tore the end of any
        other (its ``_exit`` never ran, or ran half-way). Its saved-tensor hooks, the latest
        pushed, come off, and the count is set right."""
        if self._depth <= depth and len(self._saving) <= depth:
            return
        logger.info("%s: undoing what an interrupted call left behind", self.describe())
        while len(self._saving) > depth:
            saving = self._saving[-1]
            if saving is not None:
                saving.__exit__(None, None, None)
            self._saving.pop()
        self._depth = depth

    def _child_hook(self, index: int, module: nn.Module, args) -> None:
        """A child called directly (``vae.decode``) activates its group. Traced inside a compiled
        root, where the group is active already, it is a guarded no-op, so the graph is whole."""
        if self._active != index:
            self._before_use(index)

    def _child_done(self, module: nn.Module, args, output) -> None:
        """A child called directly, outside a pipeline call and its component's own call: its
        group leaves the device (a guarded no-op inside a compiled root)."""
        if self._depth == 0 and self._calls == 0 and self._active is not None:
            self._release()

    def _release(self) -> None:
        self.release_all()

    # -- phases (phases.py) -----------------------------------------------------------------------
    def yields(self) -> list[str]:
        """Staged components (loaded around their use, no prefetch) leave the device when
        another phase begins, not only when the call ends."""
        return [] if self.prefetch else [c.name for g in self.groups for c in g.components]

    def give_way(self, component: str) -> None:
        active = self._active
        if active is not None and self._depth == 0 and any(c.name == component for c in self.groups[active].components):
            self.release_all()
