"""Model-level offload: what it swaps, components grouped, and the state of each group's load.

Shared by the swapping (model_level.py), the component calls that hold a group on the device
(model_calls.py) and the device copies saved weights reference (model_saved.py), which all read
and change the same groups: the data lives here so that none of them imports another for it.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from torch import nn

from ..device.backend import Event
from ..weights import WeightUnit
from ..weights.binding import Binding, Home
from .autograd import DeviceCopy


@dataclasses.dataclass
class Component:
    """One module with weights: its packed unit, and while its group is on the device, that copy
    and the binding between it and the host views."""

    name: str
    module: nn.Module
    unit: WeightUnit
    device: dict[torch.dtype, torch.Tensor] | None = None
    binding: Binding | None = None
    home: Home | None = None
    # its latest device copy as weights autograd saved reference it (weakly: alive while a graph is)
    copy: weakref.ref[DeviceCopy] | None = None


@dataclasses.dataclass
class Group:
    """Modules that swap together (a pipeline's text encoders, its VAE): the unit of a load, of a
    prefetch and of a swap-out, with one ready event for all its components' copies."""

    name: str
    components: list[Component]
    ready: Event | None = None
    state: str = "host"  # "host" | "loading" | "active"
    ticket: object = None  # the stager's ticket of a pending load (homes outside pinned memory)
    recorded: bool = True  # False while a load is queued: ``ready`` is recorded after its copies

    @property
    def nbytes(self) -> int:
        return sum(c.unit.nbytes for c in self.components)
