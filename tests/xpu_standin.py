"""A stand-in ``torch.xpu`` on the CPU, so that the ``xpu`` backend runs where no Intel GPU is.

:class:`StandInXpu` carries only names the real ``torch.xpu`` has (a test checks it) and gives
them the stream model of a device: a side stream is a worker thread (the fake backend's
streams), work issued under ``torch.xpu.stream(side)`` is queued there, and events record, wait
for and time stream positions. Work the host issues under the default stream runs at once, as
the fake's default stream does. The queueing is a ``TorchDispatchMode`` active while a side
stream is current on the thread: a ``copy_`` goes to the stream's worker, any other operation
waits for the stream first and then runs (stricter than a device, never looser).

:class:`StandInXpuBackend` is the real :class:`offload_core_xpu.XpuBackend`: streams, events,
stream contexts, device selection, memory figures, collectives and copies go through its code
and this module. What a CPU-only torch cannot give is supplied instead: device tensors are CPU
tensors (``device_type = "cpu"``), page-locked memory is plain memory counted as the caching host
allocator counts it, and collectives use gloo over those CPU tensors.
"""

from __future__ import annotations

import itertools
import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offload_core.device.backend import Capability
from offload_core.device.hookspecs import hookimpl
from offload_core.device.memory_accounting import AllocationTracker
from offload_core_fake.streams import DefaultStream, FakeEvent, FakeStream, FakeTimingEvent
from offload_core_fake.trace import StreamTrace
from offload_core_xpu import XpuBackend

#: the stand-in device's memory
TOTAL_BYTES = 8 << 30


class _Queueing(TorchDispatchMode):
    """While a side stream is current: queue copies on it, order everything else after it."""

    def __init__(self, stream: FakeStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            self.stream.submit(lambda: dst.copy_(src), "copy", src.nbytes)
            return dst
        self.stream.synchronize()
        return func(*args, **kwargs)


class _StreamContext:
    def __init__(self, module: StandInXpu, stream) -> None:
        self.module, self.stream, self.mode = module, stream, None

    def __enter__(self):
        self.module._stack().append(self.stream)
        if isinstance(self.stream, FakeStream):
            self.mode = _Queueing(self.stream)
            self.mode.__enter__()
        return self.stream

    def __exit__(self, *exc):
        if self.mode is not None:
            self.mode.__exit__(*exc)
        self.module._stack().pop()


class StandInXpu:
    """``torch.xpu`` as far as the accelerator base uses it (see the module docstring)."""

    def __init__(self, count: int = 2) -> None:
        self._count = count
        self._local = threading.local()
        self._timeline = StreamTrace()
        self._default = DefaultStream(self._timeline)
        self._streams: weakref.WeakSet[FakeStream] = weakref.WeakSet()
        self._ids = itertools.count(1)
        self._memory = AllocationTracker("stand-in XPU memory", capacity=TOTAL_BYTES)

    # -- devices ----------------------------------------------------------------------------
    def device_count(self) -> int:
        return self._count

    def current_device(self) -> int:
        return getattr(self._local, "device", 0)

    def set_device(self, index: int) -> None:
        self._local.device = index

    def synchronize(self, device=None) -> None:
        for stream in list(self._streams):
            stream.synchronize()

    # -- streams and events -----------------------------------------------------------------
    def Stream(self, device=None, priority: int = 0) -> FakeStream:  # noqa: N802 - torch.xpu's name
        stream = FakeStream(f"xpu-stream-{next(self._ids)}", self._timeline, None)
        self._streams.add(stream)
        return stream

    def Event(self, enable_timing: bool = False, enable_ipc: bool = False) -> FakeEvent:  # noqa: N802
        kind = FakeTimingEvent if enable_timing else FakeEvent
        return kind(self.current_stream, self._timeline)

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current_stream(self, device=None):
        stack = self._stack()
        return stack[-1] if stack else self._default

    def stream(self, stream) -> _StreamContext:
        return _StreamContext(self, stream)

    # -- memory ---------------------------------------------------------------------------------
    def memory_allocated(self, device=None) -> int:
        return self._memory.current

    def max_memory_allocated(self, device=None) -> int:
        return self._memory.peak

    def reset_peak_memory_stats(self, device=None) -> None:
        self._memory.peak = self._memory.current

    def memory_reserved(self, device=None) -> int:
        return self._memory.current  # no caching allocator: nothing held idle

    def mem_get_info(self, device=None) -> tuple[int, int]:
        return TOTAL_BYTES - self._memory.current, TOTAL_BYTES


class StandInXpuBackend(XpuBackend):
    """The ``xpu`` backend on :class:`StandInXpu` (see the module docstring)."""

    name = "xpu-stand-in"
    device_type = "cpu"  # torch.device("xpu") tensors cannot exist in a CPU-only torch
    dist_backend = "gloo"  # over the CPU tensors that stand in for device memory
    capabilities = XpuBackend.capabilities | {Capability.COLLECTIVES}
    module = StandInXpu()

    @classmethod
    def probe(cls) -> bool:
        return True

    def _device_module(self):
        return self.module

    def empty_device(self, size, dtype=torch.uint8) -> torch.Tensor:
        return self.module._memory.allocate(size, dtype)

    def empty_pinned(self, size, dtype=torch.uint8) -> torch.Tensor:
        return self._pinned.allocate(size, dtype)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self._pinned.owns(tensor)

    def host_cache_emptier(self):
        """The caching host allocator the tracker models has nothing real to give back."""
        return _nothing


def _nothing() -> None:
    pass


@hookimpl
def offload_core_register_backends(register):
    register(StandInXpuBackend)
