"""Shared test helpers: forward runs, snapshots of a module's tensors, the chaos backend."""

from __future__ import annotations

import torch
from torch import nn

import offload_core


def chaos_backend(**options) -> offload_core.DeviceBackend:
    """A fresh fake backend in chaos mode, so that a missing wait shows as NaN every time."""
    return offload_core.get_backend("fake", chaos=True, chaos_delay=0.001, **options)


def first_tensor(output) -> torch.Tensor:
    """The main tensor of a model output (diffusers' tuples and dataclasses included)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return first_tensor(output[0])
    if hasattr(output, "to_tuple"):
        return first_tensor(output.to_tuple()[0])
    if isinstance(output, dict):
        return first_tensor(next(iter(output.values())))
    raise TypeError(f"no tensor in {type(output).__name__}")


@torch.no_grad()
def forward(model: nn.Module, inputs: dict) -> torch.Tensor:
    return first_tensor(model(**inputs)).clone()


def snapshot(module: nn.Module) -> dict:
    """Everything enable/disable must preserve: per name, the tensor object identity of parameters,
    values, dtype, strides, requires_grad; and which names share storage."""
    state = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        state[name] = (
            id(t) if isinstance(t, nn.Parameter) else None,
            t.detach().clone(),
            t.dtype,
            t.stride(),
            t.requires_grad,
            t.device.type,
        )
    storages: dict[int, list[str]] = {}
    for name, t in [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]:
        if t.numel():
            storages.setdefault(t.untyped_storage().data_ptr(), []).append(name)
    sharing = sorted(sorted(names) for names in storages.values() if len(names) > 1)
    return {"tensors": state, "sharing": sharing}


def assert_same_state(before: dict, after: dict) -> None:
    assert before["tensors"].keys() == after["tensors"].keys()
    for name, (pid, value, dtype, stride, grad, dev) in before["tensors"].items():
        pid2, value2, dtype2, stride2, grad2, dev2 = after["tensors"][name]
        assert pid == pid2, f"{name}: parameter object replaced"
        assert dtype == dtype2 and stride == stride2 and grad == grad2 and dev == dev2, name
        assert torch.equal(value, value2), name
    assert before["sharing"] == after["sharing"]
