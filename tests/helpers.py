"""Shared test helpers: forward runs, snapshots of a module's tensors, the chaos backend.

Tests built on these run on the backend ``--backend`` selects: on the fake by default, on a real
device in ``ci/gpu-check.sh``. There, references are computed by a resident copy of the model on
the device, since an offloaded forward is bit-exact against the same kernels, not the CPU's.
"""

from __future__ import annotations

import copy
import os
import socket

import torch
from torch import nn

import offload_core
from offload_core.handle import HANDLE_ATTRIBUTE
from offload_core.strategies.common import to_device
from offload_core.testing.plugin import selected_backend


def chaos_backend(**options) -> offload_core.DeviceBackend:
    """A backend of the selected kind: on the fake, a fresh instance in chaos mode, so that a
    missing wait shows as NaN every time; elsewhere the shared instance (tests that pass options
    need the matching ``requires_capability`` or ``fake_only`` mark)."""
    name = selected_backend()
    if name == "fake":
        return offload_core.get_backend("fake", chaos=True, chaos_delay=0.001, **options)
    return offload_core.get_backend(name, **options) if options else offload_core.get_backend(name)


def device() -> torch.device:
    """The device of the selected backend."""
    return offload_core.get_backend(selected_backend()).device()


@torch.no_grad()
def run(model: nn.Module, *args, **kwargs):
    """``model(*args, **kwargs)`` on the selected device, results on the host. A model that is
    not offloaded runs as a resident copy on the device (on the fake: itself, on the CPU)."""
    target = device()
    if target.type == "cpu":
        return model(*args, **kwargs)
    if getattr(model, HANDLE_ATTRIBUTE, None) is None:
        model = copy.deepcopy(model).to(target)
        args, kwargs = to_device(args, target), to_device(kwargs, target)
    return _to_host(model(*args, **kwargs))


def exact_accounting() -> bool:
    """True on the fake, whose device accounting counts only the backend's own allocations (the
    weights), so that peaks can be checked to the byte; on a device, activations count too."""
    return selected_backend() == "fake"


def pipeline_reference(tiny, seed: int = 0) -> torch.Tensor:
    """The output of ``tiny`` (a :class:`offload_core.tiny.TinyPipeline`) without offload, run by
    a resident copy on the selected device."""
    target = device()
    if target.type == "cpu":
        return tiny.run(seed=seed)
    resident = copy.deepcopy(tiny)
    resident.pipe.to(target)
    return resident.run(seed=seed)


def _to_host(out):
    if isinstance(out, torch.Tensor):
        return out.cpu()
    if hasattr(out, "to_tuple"):  # diffusers' output dataclasses
        out = out.to_tuple()
    if isinstance(out, (tuple, list)):
        return type(out)(_to_host(o) for o in out)
    if isinstance(out, dict):
        return {k: _to_host(v) for k, v in out.items()}
    return out


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
    return first_tensor(run(model, **inputs)).clone()


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


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descriptors_under(folder) -> list[str]:
    """The files under ``folder`` this process holds a descriptor of (deleted ones included)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(folder)):
            found.append(target)
    return found
