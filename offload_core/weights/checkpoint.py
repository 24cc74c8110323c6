"""Models whose tensors are read from a checkpoint: meta tensors carrying the file slice their
values come from (as :data:`~.owners.SOURCE_ATTRIBUTE`), which packing reads straight into each
unit's home. ``offload_core.from_pretrained`` builds diffusers and transformers models so, each
under its library's rules for the dtype of what it loads."""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import nn

from .owners import SOURCE_ATTRIBUTE
from .slices import FileSlice


def attach_slices(model: nn.Module, sources: Mapping[str, FileSlice],
                  dtype_of: Callable[[str, torch.Tensor, FileSlice], torch.dtype],
                  requires_grad: Callable[[torch.Tensor, torch.dtype], bool]) -> dict[str, torch.Tensor]:
    """Give each tensor of ``model`` named in ``sources`` (state-dict keys) a meta replacement of
    the slice's shape and ``dtype_of(key, tensor, slice)`` carrying the slice, which packing reads
    straight into the tensor's home; returns the replacements by key. Tensors the model shares
    under several names (ties) get one replacement, so they stay shared."""
    state = model.state_dict(keep_vars=True)
    replacements: dict[int, torch.Tensor] = {}
    attached: dict[str, torch.Tensor] = {}
    for key, source in sources.items():
        t = state[key]
        new = replacements.get(id(t))
        if new is None:
            dtype = dtype_of(key, t, source)
            new = torch.empty(source.shape, dtype=dtype, device="meta")
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=requires_grad(t, dtype))
            setattr(new, SOURCE_ATTRIBUTE, source)
            replacements[id(t)] = new
        module_name, _, name = key.rpartition(".")
        module = model.get_submodule(module_name)
        (module._parameters if name in module._parameters else module._buffers)[name] = new
        attached[key] = new
    return attached
