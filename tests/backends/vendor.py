"""Stand-ins of the accelerator runtimes, shared by the backend tests and by hostmem's registered
pinned memory tests: device modules that record their calls (one with a vendor's own stream and
event classes), the backend over them, a ``torch`` with the host-cache names of one version, the
ABC signature check, and a fresh interpreter for checks that no earlier import may colour."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from offload_core_npu import NpuBackend


def run_python(code: str, *, pythonpath: Path | None = None, env: dict[str, str] | None = None) -> dict:
    """Run ``code`` in a fresh interpreter, so no earlier test's imports or device state leak in;
    the code prints one JSON document as its last line."""
    full_env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_CORE_BACKEND"}
    if pythonpath is not None:
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full_env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def signature_problems(abc_fn, impl_fn) -> list[str]:
    """Ways in which ``impl_fn`` cannot be called the way the ABC documents ``abc_fn``."""
    abc_sig, impl_sig = inspect.signature(abc_fn), inspect.signature(impl_fn)
    impl = impl_sig.parameters
    var_kinds = {p.kind for p in impl.values()} & {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}
    problems = []
    for name, param in abc_sig.parameters.items():
        if param.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            if param.kind not in var_kinds:
                problems.append(f"does not accept {param}")
            continue
        if name not in impl:
            if inspect.Parameter.VAR_KEYWORD not in var_kinds:
                problems.append(f"lacks parameter {name!r}")
            continue
        if param.default is not inspect.Parameter.empty and impl[name].default is inspect.Parameter.empty:
            problems.append(f"makes optional parameter {name!r} required")
    for name, param in impl.items():
        required = param.default is inspect.Parameter.empty and param.kind not in (
            inspect.Parameter.VAR_POSITIONAL,
            inspect.Parameter.VAR_KEYWORD,
        )
        if required and name not in abc_sig.parameters:
            problems.append(f"adds required parameter {name!r}")
    return problems


def stand_in_stream(stream_id: int) -> torch.Stream:
    """A torch.Stream handle (device type 1 is CUDA); only its identity is used."""
    return torch.Stream(stream_id=stream_id, device_index=0, device_type=1)


DEFAULT, GATHER, COMPUTE = (stand_in_stream(i) for i in range(3))


class StandInModule:
    """The device-module calls AcceleratorBackend makes, recorded; no device behind them."""

    def __init__(self, count: int = 4) -> None:
        self.count = count
        self.current = 0
        self.calls: list[tuple] = []
        self.stream_stack: list[object] = []

    def device_count(self) -> int:
        return self.count

    def current_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))
        self.current = index

    def synchronize(self, index: int) -> None:
        self.calls.append(("synchronize", index))

    def stream(self, stream):
        module = self

        class Context:
            def __enter__(self):
                module.stream_stack.append(stream)

            def __exit__(self, *exc):
                module.stream_stack.pop()

        return Context()

    def current_stream(self, device):
        return self.stream_stack[-1] if self.stream_stack else DEFAULT


class VendorStream:
    """A device module's own stream class: a synchronous stand-in device, so that work is done
    when issued, with the checks a vendor runtime makes."""

    def __init__(self, device=None, priority=0):
        self.device = torch.device(device) if device is not None else torch.device("cpu", 0)

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True

    def wait_event(self, event) -> None:
        event.wait(self)


def _require_vendor_stream(stream, what: str) -> None:
    # torch_npu's event record/wait cast their argument to the NPU stream type: anything else
    # (a generic torch.Stream) is undefined behaviour there, an error here.
    if not isinstance(stream, VendorStream):
        raise TypeError(f"{what} needs a vendor stream, got {type(stream).__name__}")


class VendorEvent:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.recorded_on = None

    def record(self, stream=None):
        stream = stream if stream is not None else VENDOR.current_stream()
        _require_vendor_stream(stream, "Event.record")
        self.recorded_on = stream

    def wait(self, stream=None):
        _require_vendor_stream(stream if stream is not None else VENDOR.current_stream(), "Event.wait")

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...


class VendorModule(StandInModule):
    """A device module with its own Stream and Event classes, stream context and memory figures."""

    Stream = VendorStream
    Event = VendorEvent

    def __init__(self) -> None:
        super().__init__(count=1)
        self.default = VendorStream()
        self.allocated, self.reserved, self.driver_free, self.total = 0, 0, 0, 0
        self.host_cache_emptied = 0

    def stream(self, stream):
        _require_vendor_stream(stream, "stream()")
        return super().stream(stream)

    def current_stream(self, device=None):
        return self.stream_stack[-1] if self.stream_stack else self.default

    def memory_allocated(self, device=None) -> int:
        return self.allocated

    def max_memory_allocated(self, device=None) -> int:
        return self.allocated

    def reset_peak_memory_stats(self, device=None) -> None: ...

    def memory_reserved(self, device=None) -> int:
        return self.reserved

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return self.driver_free, self.total

    def host_empty_cache(self) -> None:  # torch_npu's name; torch.cuda has none
        self.host_cache_emptied += 1


VENDOR = VendorModule()


class VendorBackend(NpuBackend):
    """An NPU-like device whose generic stream creation is unsupported; tensors live on the CPU so
    that a strategy can run end to end on it."""

    name = "vendor-stand-in"
    device_type = "cpu"
    dist_backend = "gloo"

    @classmethod
    def probe(cls) -> bool:
        return True

    def _device_module(self):
        return VENDOR


@pytest.fixture
def vendor_backend(monkeypatch):
    """The stand-in backend, with torch's generic stream and event constructors raising as they
    do on a device whose guard does not implement them, and plain memory as "pinned" memory."""

    def unsupported(*args, **kwargs):
        raise RuntimeError("Backend doesn't support creating a new Stream")

    # Only the backend's view of torch changes: torch itself stays intact for everything else.
    generic_unsupported = types.ModuleType("torch")
    generic_unsupported.__getattr__ = lambda name: getattr(torch, name)
    generic_unsupported.Stream = generic_unsupported.Event = unsupported
    monkeypatch.setattr("offload_core.device.accelerator.torch", generic_unsupported)
    monkeypatch.setattr("offload_core.device.accelerator._pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    VENDOR.__init__()
    return VendorBackend()


#: torch_npu's names that torch.cuda lacks (listed in torch_npu.npu.__all__)
NPU_ONLY = {"host_empty_cache"}


class Recorder:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __call__(self, name: str):
        return lambda: self.calls.append(name)


def torch_as_of(recorder: Recorder, *, host_empty_cache: bool, accelerator_empty: bool, accelerator: str | None):
    """A ``torch`` with the host-cache names of one version and build, and nothing else changed.
    Checked in the wheels: ``torch._C._host_emptyCache`` is in every CUDA build from 2.6 (not in
    CPU builds); ``torch.accelerator`` exists from 2.6, its ``empty_host_cache`` from 2.12."""
    stand_in = types.ModuleType("torch")
    stand_in.__getattr__ = lambda name: getattr(torch, name)
    stand_in._C = types.SimpleNamespace(**({"_host_emptyCache": recorder("_C._host_emptyCache")} if host_empty_cache else {}))
    names = {
        # a torch.device where the device type is registered ("npu" needs torch_npu): its type
        "current_accelerator": lambda: types.SimpleNamespace(type=accelerator) if accelerator else None,
        "device_count": lambda: 1 if accelerator else 0,
        "is_available": lambda: accelerator is not None,
    }
    if accelerator_empty:
        names["empty_host_cache"] = recorder("accelerator.empty_host_cache")
    stand_in.accelerator = types.SimpleNamespace(**names)
    return stand_in

