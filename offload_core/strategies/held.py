"""The weights a streamed part holds on the device between its blocks' loads: its resident weights
(everything outside the streamed blocks) and its kept blocks, each a unit with a device copy of its
own.

While a part holds them, these tensors show their device copy, as on a model moved to the device.
A part that never parks keeps them from enable to ``disable``, and the device copy is their truth
(``disable`` copies all of it home). A part that *parks* (a pipeline's component whose phase is over,
see ``strategies/phases.py``) gives them up while another phase runs: they go home as a component of
model-level offload does (what changed on the device, by a version counter or new data, is copied
home first; a write through ``.data`` that no counter shows is not), their device memory is freed,
and the next use of the part loads them again from their homes, which may be on disk: read once per
switch, they need no second copy in RAM. Gradients follow their weights' device.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..base.errors import OffloadedModelError
from ..weights.binding import Binding
from .common import allocate_device, copy_unit
from .part import adopt_foreign, write_back

logger = logging.getLogger(__name__)


class HeldWeights:
    """Device copies of ``units`` (the resident unit first, then the kept blocks'), bound while held."""

    def __init__(self, units: list, parks: bool) -> None:
        self.units = units
        self.parks = parks
        self.device: list[dict[torch.dtype, torch.Tensor]] = []  # per unit, empty while not held
        self.views: list[list[torch.Tensor]] = []  # per unit, what its entries show while held
        self.bindings: list[Binding] = []

    @property
    def held(self) -> bool:
        return bool(self.device)

    @property
    def nbytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    def allocate(self, backend, name: str) -> None:
        """Device buffers for every unit (an allocation that fails leaves what was allocated to
        :meth:`free`)."""
        self.device = []
        for k, unit in enumerate(self.units):
            what = f"resident weights of {name}" if k == 0 else f"kept block {unit.name} of {name}"
            self.device.append(allocate_device(backend, unit.numel, what))

    def fill(self, placement, stream, counters) -> None:
        """Queue every unit's home into its device buffers on ``stream`` (through the stager for
        a home outside pinned memory); the caller waits for ``stream`` before binding."""
        for unit, buffers in zip(self.units, self.device):
            placement.wait(copy_unit(unit, buffers, placement, stream, counters))

    def bind(self) -> None:
        """Show the device copies. A part that parks binds as a block does (its homes stay the
        truth it goes back to, and the race sanitizer watches for writes no counter shows)."""
        self.views = [unit.region_views(buffers) for unit, buffers in zip(self.units, self.device)]
        if not self.parks:
            for unit, views in zip(self.units, self.views):
                unit.bind(views)
            return
        self.bindings = [Binding(unit, unit.host_views, views) for unit, views in zip(self.units, self.views)]
        for binding in self.bindings:
            binding.to_device()
            _grads_to(binding.params, binding.params_device)
        self.views = [b.shown(u.host_views, views) for u, b, views in zip(self.units, self.bindings, self.views)]

    def unbind_home(self, backend) -> bool:
        """A part that parks lets go: every unit shows its home again, changes copied there first.
        Returns True when a tensor was given data of another layout (kept as it is: the part must
        be packed again before its next use)."""
        relaid = False
        for unit, binding in zip(self.units, self.bindings):
            relaid |= binding.to_home(functools.partial(_write_back, backend, unit))
            _grads_to(binding.params, binding.params_home)
        self.bindings, self.views = [], []
        return relaid

    def free(self) -> None:
        for binding in self.bindings:
            binding.unwatch()
        self.device, self.views, self.bindings = [], [], []

    def truth(self) -> list:
        """(unit, views its owners show, buffers holding its true values) per unit: the device
        copies while held (changes made there are not home yet), else the homes."""
        if self.views:
            return list(zip(self.units, self.views, self.device))
        return [(u, u.host_views, u.home()) for u in self.units]

    def copy_home(self, backend) -> None:
        """Before ``disable`` unpacks, for a part that never parks: the device copies, the truth
        while held (all of them: also what a write through ``.data`` changed), copied into the
        homes (a home on disk is replaced by one in RAM: the device may hold changes)."""
        for unit, views, device in self.truth() if self.views else ():
            adopt_foreign(backend, unit, views)  # the user's same-shape tensors
            if not unit.host:
                unit.image = None
                unit.host = {dtype: torch.empty(buf.numel(), dtype=dtype) for dtype, buf in device.items()}
            write_back(backend, [(unit.host[dtype], buf) for dtype, buf in device.items()])


def _write_back(backend, unit, pairs) -> None:
    """Changes to a held unit copied into its home; a home on disk cannot take them."""
    if not unit.host:
        raise OffloadedModelError(
            f"{unit.name} has its home on disk (a host_memory budget) and was changed on the device while its "
            "component held it: the change cannot be kept when the component parks. Call handle.disable() first, "
            "or give it RAM")
    write_back(backend, pairs)


def _grads_to(params: list, views: list) -> None:
    """Gradients accumulated on a parameter go where its data goes."""
    for param, view in zip(params, views):
        grad = param.grad
        if grad is not None and grad.device != view.device:
            param.grad = grad.to(view.device)
