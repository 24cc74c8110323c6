"""What ci/gpu_check.py reads from the device, and the same reading made on the simulator in a dry
run, so that every check's logic runs in CI.

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
        self._wrap(stream, "synchronize", RUNTIME_NAMES["stream.synchronize"])
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


def union(intervals: list[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


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


def proc_status(*keys: str) -> dict[str, int | None]:
    """Fields of ``/proc/self/status`` in bytes (``VmPin``, ``VmLck``); None where not readable."""
    values: dict[str, int | None] = dict.fromkeys(keys)
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            name, _, rest = line.partition(":")
            if name in values and rest.strip().endswith("kB"):
                values[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


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


def numa_node_of(address: int) -> int | None:
    """The NUMA node holding the page at ``address`` of this process (``/proc/self/numa_maps``:
    the node of the mapping that contains it, where the kernel reports one); None where unknown."""
    try:
        lines = Path("/proc/self/numa_maps").read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    starts = []
    for line in lines:
        fields = line.split()
        nodes = [f for f in fields if f.startswith("N") and "=" in f]
        starts.append((int(fields[0], 16), nodes))
    starts.sort()
    holding = [nodes for start, nodes in starts if start <= address]
    if not holding or not holding[-1]:
        return None
    best = max(holding[-1], key=lambda f: int(f.split("=")[1]))
    return int(best[1:].split("=")[0])


def link_facts(dry_run: bool, backend: Any) -> dict[str, Any]:
    """The GPU's PCIe link (generation and width, current and maximum, from ``nvidia-smi``; the
    speed and width sysfs gives for the same device beside them) and NUMA node (``/sys/bus/pci``),
    and the node of the host memory offload-core pins homes in; each fact None with the reason in
    ``unavailable`` where this machine cannot tell it. (An idle GPU may train its link down:
    the current generation can read below the maximum until work runs.)"""
    import shutil
    import subprocess

    facts: dict[str, Any] = {"pcie_generation": None, "pcie_generation_max": None, "pcie_width": None,
                             "pcie_width_max": None, "gpu_numa_node": None, "pci_bus_id": None, "home_numa_node": None,
                             "unavailable": {}}
    if not dry_run and shutil.which("nvidia-smi"):
        query = "pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            bus, gen, gen_max, width, width_max = (f.strip() for f in done.stdout.splitlines()[0].split(","))
            facts.update(pci_bus_id=bus, pcie_generation=_number(gen), pcie_generation_max=_number(gen_max),
                         pcie_width=_number(width), pcie_width_max=_number(width_max))
        else:
            facts["unavailable"]["nvidia-smi"] = (done.stderr or done.stdout).strip()[:200]
    elif dry_run:
        facts["unavailable"]["pcie"] = "dry run: no GPU to ask nvidia-smi about"
    else:
        facts["unavailable"]["pcie"] = "nvidia-smi not found"
    if facts["pci_bus_id"]:
        device = Path("/sys/bus/pci/devices") / _sysfs_bus_id(facts["pci_bus_id"])
        for name in ("current_link_speed", "max_link_speed", "current_link_width", "max_link_width"):
            try:
                facts[f"sysfs_{name}"] = (device / name).read_text().strip()  # "32.0 GT/s PCIe" is gen 5
            except OSError as exc:
                facts["unavailable"][f"sysfs_{name}"] = str(exc)
        try:
            node = int((device / "numa_node").read_text().strip())
            facts["gpu_numa_node"] = node if node >= 0 else None  # -1: one node, or the firmware did not say
            if node < 0:
                facts["unavailable"]["gpu_numa_node"] = "the kernel reports -1 (no NUMA affinity)"
        except OSError as exc:
            facts["unavailable"]["gpu_numa_node"] = str(exc)
    else:
        facts["unavailable"].setdefault("gpu_numa_node", "no PCI bus id of a GPU")
    home = _home_numa_node(backend) if backend is not None else None
    facts["home_numa_node"] = home
    if home is None:
        facts["unavailable"]["home_numa_node"] = "/proc/self/numa_maps names no node for a pinned home"
    facts["numa_nodes"] = sorted(int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*")) or None
    return facts


def _number(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _sysfs_bus_id(bus_id: str) -> str:
    """nvidia-smi's ``00000000:3B:00.0`` as sysfs names it, ``0000:3b:00.0``."""
    parts = bus_id.split(":")
    if len(parts) != 3:
        return bus_id.lower()
    return f"{int(parts[0], 16) & 0xFFFF:04x}:{parts[1].lower()}:{parts[2].lower()}"


def _home_numa_node(backend: Any) -> int | None:
    """The node of a pinned home offload-core makes on ``backend``: a small stack offloaded, its
    first home's first page asked of ``numa_maps``."""
    import offload_core
    from torch import nn

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(2))

    model = Stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    try:
        homes = [t for p in handle.parts for u in getattr(p, "units", []) for t in (u.host or {}).values()]
        return numa_node_of(homes[0].data_ptr()) if homes else None
    finally:
        handle.disable()
