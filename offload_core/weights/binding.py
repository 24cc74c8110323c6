"""Switching a unit's owners between its home (host) views and a device copy, keeping changes.

A unit's tensors show their device copy only while the device copy is in use (a block's forward, a
component's turn on the device) and their home, the truth, the rest of the time. Whatever a
forward changed in the device copy (buffers updated in place, such as running statistics or step
counters, a buffer replaced by a new tensor, a parameter edited in place) is copied back home when
the owners return there, so nothing the model did is lost and nothing stale is read later.
"""

from __future__ import annotations

import copy
import operator
from typing import Callable, Sequence

import torch

from .layout import same_layout, storage_key
from .owners import Owner
from .placeholders import PlaceholderParameter, PlaceholderTensor, swaps_class
from .unit import WeightUnit

#: copies each (home view, device tensor) pair home and returns once they have landed
WriteBack = Callable[[list[tuple[torch.Tensor, torch.Tensor]]], None]

#: called as ``hook(params, device views)`` when a unit's parameters start showing their device
#: views and ``hook(params, None)`` when they go home. A checker registers here: the fake backend's
#: race sanitizer reports a write into those device views that no version counter shows (through
#: ``.data``), which is lost when the unit goes home. Empty outside such tests.
BIND_HOOKS: list[Callable[[list[torch.nn.Parameter], list[torch.Tensor] | None], None]] = []

#: compute-dtype copies a layer computes with while its forward runs, made from what its weights
#: show (diffusers' layerwise casting, casting.py): the copy's storage address -> (the copy, the
#: tensor it was cast from). A saved-tensor hook that keeps slots out of the graph
#: (strategies/autograd.py) saves such a copy as the slot view it came from and casts it again in
#: backward, so that the graph holds no weights. Entries live from the layer's pre-forward to its
#: post-forward, and only while autograd records.
CAST_COPIES: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

_is_set_to = torch.Tensor.is_set_to
#: a tensor's version counter, mapped over a unit's parameters in C (no Python loop per tensor)
_version_of = operator.attrgetter("_version")


class Home:
    """A unit's owners and the home views they show outside the device, with a check cheap
    enough to run before every use (one call in C per tensor)."""

    __slots__ = ("params", "params_home", "buffers", "buffers_home", "composites", "composites_home", "hidden")

    def __init__(self, unit: WeightUnit, home: list[torch.Tensor]) -> None:
        self.params: list[torch.nn.Parameter] = []
        self.params_home: list[torch.Tensor] = []
        self.buffers: list[Owner] = []
        self.buffers_home: list[torch.Tensor] = []
        seen: set[int] = set()
        for entry, h in zip(unit.entries, home):
            for owner in entry.owners:
                if owner.param is None:
                    self.buffers.append(owner)
                    self.buffers_home.append(h)
                elif id(owner.param) not in seen:  # a Parameter tied into several modules: once
                    seen.add(id(owner.param))
                    self.params.append(owner.param)
                    self.params_home.append(h)
        # parameters whose home is a placeholder (weights/placeholders.py): their class says so at home
        self.hidden = [k for k, (p, h) in enumerate(zip(self.params, self.params_home))
                       if type(h) is PlaceholderTensor and swaps_class(p)]
        # quantized weights (wrapper subclasses), rebuilt once around their parts' views
        self.composites = [c.owners for c in unit.composites]
        self.composites_home = [c.rebuild([home[k] for k in c.leaves]) for c in unit.composites]

    def at_home(self) -> bool:
        """True while every owner still shows its home view (the user has not given a parameter
        new data nor replaced a buffer)."""
        return _shows(self.params, self.params_home, self.buffers, self.buffers_home)


class Homes:
    """``Home.at_home`` of many units at once (every streamed block, before each forward): one
    call per tensor, in C, over all of them, instead of a Python loop per unit."""

    __slots__ = ("_params", "_params_home", "_buffers", "_buffers_home")

    def __init__(self, homes: Sequence[Home]) -> None:
        self._params = [p for h in homes for p in h.params]
        self._params_home = [v for h in homes for v in h.params_home]
        self._buffers = [o for h in homes for o in h.buffers]
        self._buffers_home = [v for h in homes for v in h.buffers_home]

    def at_home(self) -> bool:
        return _shows(self._params, self._params_home, self._buffers, self._buffers_home)

    def buffers_at_home(self) -> bool:
        """The buffer half of ``at_home`` (one identity test per buffer; a parameter's check, which
        reads its layout, costs more)."""
        return _hold(self._buffers, self._buffers_home)


def _shows(params: list, homes: list[torch.Tensor], buffers: list[Owner], views: list[torch.Tensor]) -> bool:
    """Whether each of ``params`` still shows its view in ``homes`` and each buffer owner still
    holds its view in ``views``. A parameter must show the view exactly: its memory, offset, shape
    and strides (``p.data = p.data.t()`` keeps the memory and changes what the model computes)."""
    return all(map(_is_set_to, params, homes)) and _hold(buffers, views)


def _hold(buffers: list[Owner], views: list[torch.Tensor]) -> bool:
    """Whether each buffer owner still holds its view in ``views`` (the tensor itself)."""
    return all(map(operator.is_, map(Owner.get, buffers), views))


def _kept(tensor: torch.Tensor, home: torch.Tensor, device: torch.Tensor) -> torch.Tensor:
    """``tensor``, which a use left in place of a unit's tensor in another layout than ``device``
    (the device view) and which is kept as the truth: a host copy (on ``home``'s device, strides of
    a dense layout kept, a copy the host waits for) when it is on the device, where it would stay
    after ``disable()``, or views the device copy, which the slot's next load overwrites."""
    if tensor.device != home.device or storage_key(tensor) == storage_key(device):
        return tensor.to(home.device, copy=True)
    return tensor


class Binding(Home):
    """One unit's owners, their home views and one set of device views, precomputed so that the
    switch costs one assignment per tensor."""

    __slots__ = ("params_device", "buffers_device", "_versions", "_buffer_versions", "composites_device", "base")

    def __init__(self, unit: WeightUnit, home: list[torch.Tensor], device: list[torch.Tensor]) -> None:
        super().__init__(unit, home)
        by_home = {id(h): d for h, d in zip(home, device)}
        self.params_device = [by_home[id(h)] for h in self.params_home]
        # a buffer's device view gets a version counter of its own (``.data``), so that copies into
        # the rest of the device buffer do not look like the forward changing the buffer
        self.buffers_device = [by_home[id(h)].data for h in self.buffers_home]
        self._versions = self.versions()
        self._buffer_versions: list[int] = []
        self.composites_device = [c.rebuild([device[k] for k in c.leaves]) for c in unit.composites]
        self.base: Binding | None = None  # the binding this one substitutes for (see ``substituted``)

    def relaid(self) -> list[int]:
        """Indices of the parameters given data of another shape, strides or dtype than their home
        view (``p.data = w.t()``, ``p.data = w.half()``): a structural change, which the unit's
        slot layout cannot hold."""
        return [k for k, (p, home) in enumerate(zip(self.params, self.params_home))
                if not p.is_set_to(home) and not same_layout(p, home)]

    def substituted(self, device: dict[int, torch.Tensor]) -> Binding:
        """This binding, with parameter ``k`` (each key of ``device``) showing the data it holds
        now at home and ``device[k]`` (a device copy of that data) on the device: for a unit
        that cannot be packed again before it runs. ``base`` is the unit's packed binding, kept
        alive with the slot views it holds: the ring counts their uses (ring.py)."""
        other = copy.copy(self)
        other.params_home, other.params_device = list(self.params_home), list(self.params_device)
        for k, tensor in device.items():
            other.params_home[k] = self.params[k].data
            other.params_device[k] = tensor
        other.base = self if self.base is None else self.base
        return other

    def versions(self) -> tuple[int, ...]:
        """The parameters' version counters (each in-place write through a parameter moves its own)."""
        return tuple(map(_version_of, self.params))

    def touched(self) -> bool:
        """True if a parameter was changed in place (through the parameter itself) since the unit
        last went to the device."""
        return self.versions() != self._versions

    def to_device(self) -> None:
        """Show the device views; remember version counters to see in-place changes later."""
        for p, view in zip(self.params, self.params_device):
            p.data = view
        for k in self.hidden:
            self.params[k].__class__ = torch.nn.Parameter
        self._versions = self.versions()
        for hook in BIND_HOOKS:
            hook(self.params, self.params_device)
        for owners, tensor in zip(self.composites, self.composites_device):
            for owner in owners:
                owner.rebind(tensor)
        if self.buffers:
            for owner, view in zip(self.buffers, self.buffers_device):
                owner.module._buffers[owner.name] = view
            self._buffer_versions = [v._version for v in self.buffers_device]

    def shown(self, home: list[torch.Tensor], device: list[torch.Tensor]) -> list[torch.Tensor]:
        """What each of the unit's entries shows on the device (``device``, the views this binding
        was made with, aligned with ``home``): its view, or a buffer's own alias of it."""
        aliases = {id(h): d for h, d in zip(self.buffers_home, self.buffers_device)}
        return [aliases.get(id(h), d) for h, d in zip(home, device)]

    def unwatch(self) -> None:
        """Tell the checkers of ``BIND_HOOKS`` the parameters no longer show the device views
        (their unit is given up without going home: ``disable`` copies every value home itself)."""
        for hook in BIND_HOOKS:
            hook(self.params, None)

    def to_home(self, write_back: WriteBack) -> bool:
        """Show the home views again, first copying home (``write_back`` of (home, device view)
        pairs) whatever changed on the device.

        Returns True when a buffer was replaced, or a parameter given data, of another shape or
        dtype: that tensor is left in its module (it is the truth) and the unit must be re-packed."""
        params = self.params
        self.unwatch()
        changed: list[tuple[torch.Tensor, torch.Tensor]] = []
        if self.versions() != self._versions:  # rare: a forward edited a weight in place
            changed = [
                (home, device)
                for p, home, device, version in zip(params, self.params_home, self.params_device, self._versions)
                if p._version != version
            ]
        kept = self._data_changes(changed)
        replaced: list[int] = []
        if self.buffers:
            changed += self._buffer_changes(replaced)
        try:
            if changed:
                write_back(changed)
        finally:  # home again even if copying home failed: the home views are still the truth
            homes = zip(params, self.params_home)
            if kept:  # rare: those keep the data they were given
                homes = (pair for k, pair in enumerate(homes) if k not in kept)
            for p, view in homes:
                p.data = view
            for k in self.hidden:
                if k not in kept:
                    params[k].__class__ = PlaceholderParameter
            for k, (owner, view) in enumerate(zip(self.buffers, self.buffers_home)):
                if k not in replaced:
                    owner.module._buffers[owner.name] = view
            for owners, tensor in zip(self.composites, self.composites_home):
                for owner in owners:
                    owner.rebind(tensor)
        return bool(replaced or kept)

    def _data_changes(self, changed: list[tuple[torch.Tensor, torch.Tensor]]) -> set[int]:
        """Parameters given new data during the use (``p.data = t`` in a hook or a forward), which
        no version counter shows: like a replaced Parameter, the new data is the truth. Of the
        same shape, strides and dtype it is copied home (into ``changed``); anything else is left
        in the parameter (``_kept``), and the returned indices make the unit re-pack around it."""
        kept: set[int] = set()
        if all(map(_is_set_to, self.params, self.params_device)):  # the rule, checked in C: nothing to do
            return kept
        for k, (p, device) in enumerate(zip(self.params, self.params_device)):
            if p.is_set_to(device) or p.is_set_to(self.params_home[k]):  # on the device, or home already
                continue
            if same_layout(p, device):
                changed[:] = [pair for pair in changed if pair[1] is not device]
                changed.append((self.params_home[k], p.data))
                continue
            p.data = _kept(p.data, self.params_home[k], device)
            kept.add(k)
        return kept

    def _buffer_changes(self, replaced: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(home, device view) of each buffer the forward changed in place or replaced by a tensor
        of the device view's shape, strides and dtype (copied into it first); the index of each
        replaced by anything else goes to ``replaced``. A buffer of a module in training mode counts
        as changed whatever its version: kernels update running statistics (BatchNorm's
        ``running_mean`` and ``running_var``) without moving the version counter."""
        changed = []
        for k, (owner, home, device, version) in enumerate(
            zip(self.buffers, self.buffers_home, self.buffers_device, self._buffer_versions)
        ):
            current = owner.module._buffers.get(owner.name)
            if current is device:
                if device._version != version or owner.module.training:
                    changed.append((home, device))
            elif current is not None and same_layout(current, device):  # (a home may be a placeholder)
                device.copy_(current)  # on the compute stream, like the forward that made it
                changed.append((home, device))
            else:
                if current is not None:
                    owner.module._buffers[owner.name] = _kept(current, home, device)
                replaced.append(k)
        return changed
