"""What ci/gpu_check.py reads from the device, and the same reading made on the simulator in a dry
run, so that every check's logic runs in CI (what it reads of the host is in ci/gpu_host.py).

A check asks a :class:`Probe` for what only the device can tell: a profiler trace of some work
(kernels on the compute stream, host-to-device copies, runtime API calls), the driver's view of
device memory, the caching allocator's counters. :class:`CudaProbe` reads them from torch's CUDA
profiler and ``torch.cuda``; :class:`SimProbe` makes the same trace on the fake backend from
torch's CPU profiler (the thread that runs the model is the fake's compute stream: its top-level
operators are its "kernels"), the fake's own stream log (its copies) and the backend calls a
:class:`Calls` log saw (named after the CUDA runtime calls the CUDA backend makes for them), and
marks it simulated. Both traces are read by one parser, :func:`read_trace`.

This file is the check, not the core: it may call ``torch.cuda``.
"""

from __future__ import annotations

import collections
import functools
import json
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from offload_core.common.overlap import union

#: the CUDA runtime call each backend operation makes on the CUDA backend
RUNTIME_NAMES = {
    "copy_async": "cudaMemcpyAsync",
    "record": "cudaEventRecord",
    "wait": "cudaStreamWaitEvent",
    "wait_stream": "cudaStreamWaitEvent",
    "event.synchronize": "cudaEventSynchronize",
    "stream.synchronize": "cudaStreamSynchronize",
    "synchronize": "cudaDeviceSynchronize",
}
#: the runtime calls counted per block: copies, event records and waits, host synchronisations
COUNTED_CALLS = ("cudaMemcpyAsync", "cudaEventRecord", "cudaStreamWaitEvent", "cudaEventSynchronize",
                 "cudaStreamSynchronize", "cudaDeviceSynchronize")
#: runtime calls that block the host until device work is done
SYNCHRONISING_CALLS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize")
#: operators on the simulator's compute thread that compute nothing (views, checks, allocations):
#: left out of its "kernels"
BOOKKEEPING = frozenset({
    "aten::is_set_to", "aten::_has_compatible_shallow_copy_type", "aten::as_strided", "aten::resolve_conj",
    "aten::resolve_neg", "aten::detach", "aten::detach_", "aten::alias", "aten::view", "aten::_reshape_alias",
    "aten::t", "aten::transpose", "aten::expand", "aten::empty", "aten::empty_strided", "aten::set_",
    "aten::lift_fresh", "aten::slice", "aten::select", "aten::unsqueeze", "aten::squeeze", "aten::reshape",
    "aten::permute", "aten::split", "aten::chunk", "aten::unbind", "aten::to", "aten::_to_copy", "aten::contiguous",
    "aten::result_type", "aten::zeros", "aten::ones", "aten::full", "aten::item", "aten::_local_scalar_dense",
})

Interval = tuple[float, float]
#: the simulated device of the dry run's near-capacity check
CAPACITY = 16 << 20


# -- the backend's calls ---------------------------------------------------------------------------


class Calls:
    """Every synchronisation, event record and wait, and copy a backend was asked for after
    :meth:`instrument`, with its host time: ``(runtime name, start ns, end ns)``. Streams and events
    the backend hands out later are instrumented as they are made. A device synchronisation is
    one call: what the backend does inside it (the fake synchronises each of its streams) is not
    logged again."""

    def __init__(self) -> None:
        self.log: list[tuple[str, int, int]] = []
        self._lock = threading.Lock()
        self._inside = threading.local()

    def _wrap(self, obj: Any, method: str, name: str, whole: bool = False) -> None:
        """Log each call of ``obj.method`` as ``name``; ``whole``: the calls made inside it are its own."""
        original = getattr(obj, method)

        @functools.wraps(original)
        def called(*args: Any, **kwargs: Any) -> Any:
            if getattr(self._inside, "whole", False):
                return original(*args, **kwargs)
            self._inside.whole = whole
            start = time.perf_counter_ns()
            try:
                return original(*args, **kwargs)
            finally:
                self._inside.whole = False
                with self._lock:
                    self.log.append((name, start, time.perf_counter_ns()))

        setattr(obj, method, called)

    def _stream(self, stream: Any) -> Any:
        if not getattr(stream, "_gpu_check_logged", False):  # a backend may hand out one stream many times
            self._wrap(stream, "synchronize", RUNTIME_NAMES["stream.synchronize"])
            stream._gpu_check_logged = True
        return stream

    def _event(self, event: Any) -> Any:
        for method, name in (("record", "record"), ("wait", "wait"), ("synchronize", "event.synchronize")):
            self._wrap(event, method, RUNTIME_NAMES[name])
        return event

    def instrument(self, backend: Any) -> Any:
        """Log ``backend``'s calls from now on (before any stream or event a strategy keeps is made)."""
        for method in ("synchronize", "copy_async", "wait_stream"):
            self._wrap(backend, method, RUNTIME_NAMES[method], whole=method == "synchronize")
        for method, instrument in (("new_stream", self._stream), ("current_stream", self._stream),
                                   ("new_event", self._event)):
            original = getattr(backend, method)
            setattr(backend, method, functools.partial(lambda f, wrap, *a, **k: wrap(f(*a, **k)), original, instrument))
        return backend

    def counts(self, since: int = 0) -> collections.Counter:
        with self._lock:
            return collections.Counter(name for name, _, _ in self.log[since:])


# -- traces ------------------------------------------------------------------------------------------


def covered(spans: list[Interval], by: list[Interval]) -> float:
    """Share of the total length of ``spans`` that lies inside the union of ``by``."""
    merged = union(by)
    total = sum(end - start for start, end in spans)
    inside = sum(max(0.0, min(end, m_end) - max(start, m_start)) for start, end in spans for m_start, m_end in merged)
    return inside / total if total else 0.0


class Trace:
    """A profiler trace read back: kernels of the compute stream, host-to-device copies, runtime
    calls by name (times in µs), and whether it is the simulator's."""

    def __init__(self, path: Path, kernels: list[Interval], copies: list[Interval], calls: collections.Counter,
                 window: Interval, simulated: bool) -> None:
        self.path, self.kernels, self.copies, self.calls = path, kernels, copies, calls
        self.window, self.simulated = window, simulated

    @property
    def window_us(self) -> float:
        return max(self.window[1] - self.window[0], 0.0)

    @property
    def compute_busy_us(self) -> float:
        return sum(end - start for start, end in union(self.kernels))

    @property
    def compute_idle_us(self) -> float:
        """Time in the trace's window during which the compute stream ran no kernel."""
        return max(self.window_us - self.compute_busy_us, 0.0)

    @property
    def copies_under_kernels(self) -> float:
        """Share of host-to-device copy time that ran while a compute kernel ran."""
        return covered(self.copies, self.kernels)

    def summary(self) -> dict[str, Any]:
        return {"trace": self.path.name, "window_us": self.window_us, "compute_idle_us": self.compute_idle_us,
                "h2d_copies": len(self.copies), "kernels": len(self.kernels),
                "h2d_time_under_kernels": self.copies_under_kernels,
                "runtime_calls": {name: self.calls.get(name, 0) for name in COUNTED_CALLS},
                "simulated": self.simulated}


def read_trace(path: Path) -> Trace:
    """Read a Chrome trace written by torch's profiler (and, for the simulator, completed by
    :class:`SimProbe`): the compute stream is the stream with the most kernel time; the window runs
    from the first device activity to the last."""
    document = json.loads(path.read_text(encoding="utf-8"))
    events = [e for e in document.get("traceEvents", []) if e.get("ph") == "X"]
    kernels_by_stream: dict[Any, list[Interval]] = collections.defaultdict(list)
    copies: list[Interval] = []
    device: list[Interval] = []
    calls: collections.Counter = collections.Counter()
    for e in events:
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        category = e.get("cat", "")
        if category == "kernel":
            kernels_by_stream[(e.get("args") or {}).get("stream")].append(span)
            device.append(span)
        elif category == "gpu_memcpy":
            device.append(span)
            if "HtoD" in e.get("name", ""):
                copies.append(span)
        elif category == "gpu_memset":
            device.append(span)
        elif category in ("cuda_runtime", "cuda_driver"):
            calls[e.get("name", "")] += 1
    compute = max(kernels_by_stream.values(), key=lambda spans: sum(b - a for a, b in spans), default=[])
    window = (min(s for s, _ in device), max(e for _, e in device)) if device else (0.0, 0.0)
    return Trace(path, compute, copies, calls, window, bool(document.get("simulated")))


# -- probes --------------------------------------------------------------------------------------------


class CudaProbe:
    """The device: torch's CUDA profiler and allocator."""

    simulated = False

    def __init__(self, backend: Any) -> None:
        self.backend = backend

    def profile(self, work: Callable[[], None], path: Path) -> Trace:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            work()
            torch.cuda.synchronize()
        prof.export_chrome_trace(str(path))
        return read_trace(path)

    def driver_mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.backend.device())

    def allocator_idle_reserve(self) -> int:
        device = self.backend.device()
        return torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def allocator_counters(self) -> dict[str, int | None]:
        stats = torch.cuda.memory_stats(self.backend.device())
        return {"num_ooms": stats.get("num_ooms", 0), "num_alloc_retries": stats.get("num_alloc_retries", 0)}

    def cached_pinned(self, nbytes: int) -> torch.Tensor:
        """Pinned memory from the caching host allocator (what ``pin_memory=True`` gives)."""
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def capacity(self) -> tuple[Any, "CudaProbe"]:
        """The backend and probe of the near-capacity check: the device itself."""
        return self.backend, self

    def exact_math(self) -> None:
        """fp32 as on the host: TF32 off, so that bit-equality with resident is meaningful."""
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


class SimProbe:
    """The fake backend in a dry run: every reading made the device's way, marked simulated.

    ``calls`` logs the backend's calls (:class:`Calls`); the fake is made with its caching device
    allocator on (``device_cache``), so that its free memory has the driver's and the allocator's
    parts a GPU's has, and counts out-of-memory errors as the caching allocator does."""

    simulated = True

    def __init__(self, backend: Any, calls: Calls) -> None:
        self.backend, self.calls = backend, calls
        self.ooms = 0

    def profile(self, work: Callable[[], None], path: Path) -> Trace:
        from torch.profiler import ProfilerActivity, profile, record_function

        self.backend.synchronize()
        since, spans_before = len(self.calls.log), len(self.backend.timeline.spans())
        clock = time.time_ns() - time.perf_counter_ns()  # the profiler's wall clock, from ours
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            with record_function("gpu-check: profiled work"):
                work()
                self.backend.synchronize()
        prof.export_chrome_trace(str(path))
        document = json.loads(path.read_text(encoding="utf-8"))
        base = int(document.get("baseTimeNanoseconds", 0))

        def us(ns: int) -> float:
            return (ns + clock - base) / 1e3

        events = document["traceEvents"]
        marker = next(e for e in events if e.get("name") == "gpu-check: profiled work" and e.get("ph") == "X")
        simulated: list[dict[str, Any]] = []
        # the compute thread's top-level operators are the fake's kernels, on its one compute stream
        ops = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") == "cpu_op"
                      and e.get("tid") == marker["tid"]), key=lambda e: (e["ts"], -e.get("dur", 0)))
        end = -1.0
        for e in ops:
            if e["ts"] >= end:  # not inside the operator before it
                end = e["ts"] + e.get("dur", 0.0)
                if e["name"] not in BOOKKEEPING:
                    simulated.append({"ph": "X", "cat": "kernel", "name": e["name"], "pid": "simulated device",
                                      "tid": "compute", "ts": e["ts"], "dur": e.get("dur", 0.0),
                                      "args": {"stream": "compute"}})
        for span in self.backend.timeline.spans()[spans_before:]:
            if span.name == "H2D":
                simulated.append({"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (simulated)",
                                  "pid": "simulated device", "tid": span.stream, "ts": us(span.start_ns),
                                  "dur": (span.end_ns - span.start_ns) / 1e3,
                                  "args": {"stream": span.stream, "bytes": span.nbytes}})
        with self.calls._lock:
            logged = self.calls.log[since:]
        simulated += [{"ph": "X", "cat": "cuda_runtime", "name": name, "pid": "simulated runtime", "tid": "host",
                       "ts": us(start), "dur": (stop - start) / 1e3} for name, start, stop in logged]
        document["traceEvents"] = events + simulated
        document["simulated"] = True
        path.write_text(json.dumps(document), encoding="utf-8")
        return read_trace(path)

    def driver_mem_get_info(self) -> tuple[int, int]:
        _, total = self.backend.mem_get_info()
        return max(total - self.backend.memory_reserved(), 0), total

    def allocator_idle_reserve(self) -> int:
        return self.backend.memory_reserved() - self.backend.memory_allocated()

    def empty_cache(self) -> None:
        self.backend.empty_cache()

    def allocator_counters(self) -> dict[str, int | None]:
        return {"num_ooms": self.ooms, "num_alloc_retries": None}  # the fake retries nothing

    def cached_pinned(self, nbytes: int) -> torch.Tensor:
        """Pinned memory from the fake's caching host pool (a second fake, which rounds as torch's
        caching host allocator does)."""
        import offload_core

        if not hasattr(self, "_caching"):
            self._caching = offload_core.get_backend("fake", chaos=False, pinned_rounding="pow2")
        return self._caching.empty_pinned(nbytes)

    def exact_math(self) -> None:
        """The host's fp32 is exact already."""

    def capacity(self) -> tuple[Any, "SimProbe"]:
        """A fake of :data:`CAPACITY` bytes with a caching allocator, whose out-of-memory errors
        are counted as the caching allocator counts them, and its probe."""
        import offload_core

        backend = offload_core.get_backend("fake", chaos=False, device_cache=True, device_memory=CAPACITY,
                                           inline_copy_bytes=0, sanitize=False)
        probe = SimProbe(backend, Calls())
        empty_device = backend.empty_device

        def counted(*args: Any, **kwargs: Any) -> torch.Tensor:
            try:
                return empty_device(*args, **kwargs)
            except torch.OutOfMemoryError:
                probe.ooms += 1
                raise

        backend.empty_device = counted
        return backend, probe


def make_probe(dry_run: bool) -> tuple[Any, Any, Calls]:
    """(backend, probe, calls): the CUDA backend and the device, or the fake (caching device
    allocator, registered pinned memory, copies on their stream threads) and the simulator; the
    backend's calls logged in both."""
    import offload_core

    calls = Calls()
    if dry_run:
        backend = offload_core.get_backend("fake", chaos=False, device_cache=True, pinned_rounding="register",
                                           inline_copy_bytes=0, sanitize=False)
        return calls.instrument(backend), SimProbe(backend, calls), calls
    backend = offload_core.get_backend("cuda")
    return calls.instrument(backend), CudaProbe(backend), calls
