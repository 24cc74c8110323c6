"""Model-level offload: the device copies that weights autograd saved reference, and how long they live.

A recording forward saves a component's weights as references into its device copy
(``DeviceCopy``, autograd.py), so that the usual forward-then-backward reads them without a reload.
Such a copy must not outlive the component's next load or ``disable()``: a graph kept without a
backward would hold a whole component's device memory. It is released then, and a backward that
still needs it makes the group active again and reads its current copy (the saved weights'
versions prove they did not change). Kept apart from the swapping (model_level.py): this is the
one place where autograd, not a call, brings a group back to the device.
"""

from __future__ import annotations

import weakref

import torch

from ..base.locks import locked
from .autograd import DeviceCopy, at_backward_end
from .model_groups import Component
from .part import Part


class SavedCopies(Part):
    """One :class:`DeviceCopy` per component load, shared by every graph recorded while it lasts,
    and the reads of a released one by a backward. ``epoch`` counts enables: a copy saved before a
    re-pack or ``disable()`` has another layout, and reading it is an error naming the cause.
    Mixed into ``ModelLevelOffload``, whose groups, call counts (model_calls.py) and swapping
    (``_before_use``, ``release_all``) it uses."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self.epoch = 0  # counts enables: a released device copy is read again within one

    def _device_copies(self, index: int) -> list[DeviceCopy]:
        """The device copies of group ``index`` (active) as the weights a recording forward saves
        reference them: one per load, shared by every graph recorded while it lasts."""
        copies = []
        for c in self.groups[index].components:
            copy = c.copy() if c.copy is not None else None
            if copy is None:
                copy = DeviceCopy(weakref.ref(self), c.name, self.epoch, c.device)
                c.copy = weakref.ref(copy)
            copies.append(copy)
        return copies

    def saved_buffers(self, copy: DeviceCopy) -> dict[torch.dtype, torch.Tensor]:
        """A backward reads weights it saved from ``copy``, which was released (the component was
        loaded again since, or ``disable()`` ran): the component's group becomes active again, as
        for a forward, and its current device copy is read (the saved weights' versions say they
        did not change since). A group this made active goes home when the backward ends (outside
        a pipeline call); read outside a backward, the weights are a copy and the group goes home
        at once."""
        return locked(self.lock, self._saved_buffers, copy)

    def _saved_buffers(self, copy: DeviceCopy) -> dict[torch.dtype, torch.Tensor]:
        self._check_layout(copy)
        index = next(i for i, g in enumerate(self.groups) for c in g.components if c.name == copy.name)
        swapped, outside_calls = self._active != index, self._depth == 0 and self._calls == 0
        self._before_use(index)
        self._check_layout(copy)  # a structure changed since the forward re-packs on the way in
        component = next(c for c in self.groups[index].components if c.name == copy.name)
        if not swapped or not outside_calls or at_backward_end(self._after_backward):
            return component.device
        buffers = {dtype: b.clone() for dtype, b in component.device.items()}
        self.release_all()
        return buffers

    def _check_layout(self, copy: DeviceCopy) -> None:
        if not self.enabled or copy.epoch != self.epoch:
            raise RuntimeError(
                f"this backward reads weights of {copy.name}, but its model-level offload was disabled or re-packed "
                "(a structural change) since the forward that saved them: run backward before handle.disable() "
                "or before changing the model's structure"
            )

    def _after_backward(self) -> None:
        """A backward that made groups active to read saved weights ended: they go home, unless a
        call began meanwhile."""
        locked(self.lock, self._release_after_backward)

    def _release_after_backward(self) -> None:
        if self.enabled and self._depth == 0 and self._calls == 0:
            self.release_all()


def release_copy(c: Component) -> None:
    """The component's latest device copy is released (its next load, ``disable()``): graphs that
    saved weights from it read them again through ``saved_buffers`` if a backward comes."""
    copy = c.copy() if c.copy is not None else None
    if copy is not None:
        copy.release()
    c.copy = None
