"""Where a tensor is reachable from: the owners (``module.<name>``) a unit re-points, found by
walking modules, and the tensors that can be packed at all."""

from __future__ import annotations

import dataclasses
from typing import Iterable

import torch
from torch import nn

from ..base.errors import UnsupportedTensorError
from .subclass import assign_param, like

#: attribute of a meta tensor naming where its values are (an object with ``read(start, count, out)``)
SOURCE_ATTRIBUTE = "_offload_core_source"


@dataclasses.dataclass(eq=False)
class Owner:
    """One place a tensor is reachable from: ``module.<name>`` as a parameter or a buffer.

    ``param`` is the Parameter object the unit manages: rebinding changes that object's data, never
    a Parameter the user has put in its place since (that one is the user's truth)."""

    module: nn.Module
    name: str
    param: nn.Parameter | None = None  # None for a buffer

    @property
    def is_param(self) -> bool:
        return self.param is not None

    def get(self) -> torch.Tensor | None:
        """What the module holds under this name now."""
        return (self.module._parameters if self.param is not None else self.module._buffers).get(self.name)

    def rebind(self, tensor: torch.Tensor) -> None:
        if self.param is not None:
            assign_param(self.param, tensor)
        else:
            current = self.module._buffers.get(self.name)
            self.module._buffers[self.name] = tensor if current is None else like(current, tensor)

    def bound_to(self, view: torch.Tensor) -> bool:
        """True while this owner still shows ``view`` (the tensor it was last bound to), i.e. the
        user has neither replaced the Parameter or buffer nor assigned the parameter new data (a
        view of the same memory in another shape or strides included)."""
        current = self.get()
        if self.param is None:
            return current is view
        # a parameter still on the meta device (a checkpoint slice not read yet) shows no real view
        return current is self.param and current.device == view.device and current.is_set_to(view)

    def replace(self, tensor: torch.Tensor) -> None:
        """Install ``tensor`` itself (a new parameter object, which the unit manages from now on):
        ``.data`` cannot move a parameter off the meta device."""
        if self.param is not None:
            self.module._parameters[self.name] = self.param = tensor
        else:
            self.module._buffers[self.name] = tensor



def collect_tensors(modules: Iterable[nn.Module]) -> dict[int, tuple[torch.Tensor, list[Owner]]]:
    """Every parameter and buffer reachable from ``modules``, by tensor identity, with owners."""
    found: dict[int, tuple[torch.Tensor, list[Owner]]] = {}
    seen_modules: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen_modules:
                continue
            seen_modules.add(id(module))
            for is_param, table in ((True, module._parameters), (False, module._buffers)):
                for name, t in table.items():
                    if t is None:
                        continue
                    found.setdefault(id(t), (t, []))[1].append(Owner(module, name, t if is_param else None))
    return found



def check_supported(t: torch.Tensor, where: str) -> None:
    if t.is_meta and getattr(t, SOURCE_ATTRIBUTE, None) is None:
        raise UnsupportedTensorError(f"{where} is on the meta device: load real weights before enabling offload")
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedTensorError(f"{where} has layout {t.layout}; only strided tensors can be offloaded")

