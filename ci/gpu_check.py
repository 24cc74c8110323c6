"""The hardware checks of ci/gpu-check.sh, and its final table.

Subcommands (run by the script, with offload-core imported from the wheel it installed):

* ``environment --out FILE.json``: torch, CUDA, device, the PCIe link and NUMA nodes, and which
  of the APIs that differ between torch versions this torch has; fails if offload-core is not
  the installed wheel, or (not a dry run) no GPU.
* ``hardware --out FILE.json [--dry-run]``: the checks, in order, each one pass/FAIL line; the
  profiler traces they make are kept beside FILE.json. With ``--dry-run`` every check runs on the
  fake backend at tiny sizes through the simulator's probe (ci/gpu_probe.py): its figures are
  marked simulated, the targets that are about speed are not judged (they would measure the
  simulator), and everything else is (exactness, counts, memory accounting).
* ``table --report FILE.json --out FILE.md``: the table a user reads, from the script's JSON report.
* ``estimate``: the seconds the whole check takes on an H200, from the work it does.

This file is the check, not the core: it may call ``torch.cuda``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import inspect
import json
import math
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the check's own modules, never the checkout's package

import torch  # noqa: E402
from torch import nn  # noqa: E402

import gpu_host  # noqa: E402
import gpu_probe  # noqa: E402
import gpu_sweep  # noqa: E402

STEPS = 20  # forwards per exactness run


# -- a model with big or small blocks ---------------------------------------------------------


class Block(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(d, hidden)
        self.down = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Stack(nn.Module):
    def __init__(self, d: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(depth))
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


#: (width, hidden, blocks, tokens): copy-bound (big blocks, one short input) and compute-bound
CONFIGS = {"copy-bound": (2048, 8192, 8, 16), "compute-bound": (1024, 4096, 8, 16384)}
TINY_CONFIGS = {"copy-bound": (64, 256, 4, 2), "compute-bound": (16, 32, 4, 64)}


def _stack(config: tuple[int, int, int, int], seed: int = 0) -> tuple[nn.Module, list[torch.Tensor]]:
    d, hidden, depth, tokens = config
    torch.manual_seed(seed)
    model = Stack(d, hidden, depth).eval()
    g = torch.Generator().manual_seed(seed + 1)
    return model, [torch.randn(tokens, d, generator=g) for _ in range(STEPS)]


# -- checks ------------------------------------------------------------------------------------


class Check:
    """One line of the report: ``ok`` is True or False, with the figures. In a dry run the figures
    are the simulator's (``simulated``), and a target about speed is not judged."""

    def __init__(self, name: str, target: str) -> None:
        self.name, self.target = name, target
        self.ok: bool | None = None
        self.summary = ""
        self.simulated = False
        self.figures: dict[str, Any] = {}

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "target": self.target, "summary": self.summary,
                "simulated": self.simulated, "figures": self.figures}

    def line(self) -> str:
        state = "not run" if self.ok is None else "pass" if self.ok else "FAIL"
        return f"gpu-check: {state}: {self.name}: {self.summary}"


class Run:
    """What every check shares: the backend (its calls logged), the probe, where traces go, and
    whether this is the dry run."""

    def __init__(self, dry_run: bool, out: Path) -> None:
        self.dry_run, self.out = dry_run, out
        if dry_run:
            torch.set_num_threads(1)  # tiny operators: more threads only contend with the copy threads
        self.backend, self.probe, self.calls = gpu_probe.make_probe(dry_run)
        # host time per block is measured without the call log's wrappers where the profiler
        # counts the runtime calls itself (the device); the simulator has no other count
        self.host_backend = self.backend if dry_run else type(self.backend)()
        self.sizes = gpu_sweep.DRY if dry_run else gpu_sweep.GPU
        self.configs = TINY_CONFIGS if dry_run else CONFIGS
        self.h2d_bytes_per_s: float | None = None

    def bandwidth(self) -> float:
        """The plain pinned host-to-device copy's bytes per second (measured once)."""
        from offload_core.bench.realsize import pinned_copy_bandwidth

        if self.h2d_bytes_per_s is None:
            self.h2d_bytes_per_s = pinned_copy_bandwidth(self.backend, 1 << 20 if self.dry_run else 1 << 30)
        return self.h2d_bytes_per_s

    def judged(self, check: Check, speed_ok: bool, other_ok: bool = True) -> bool:
        """A check's verdict: on the device, its speed target and the rest; on the simulator, the
        rest alone (the speed is the simulator's)."""
        check.simulated = self.dry_run
        return other_ok and (speed_ok or self.dry_run)


def _timed_steps(backend, model: nn.Module, inputs: list[torch.Tensor], device) -> tuple[list[torch.Tensor], float]:
    """Outputs (on the host) and mean seconds per step after the first."""
    outputs, start = [], 0.0
    with torch.no_grad():
        for i, x in enumerate(inputs):
            if i == 1:
                backend.synchronize()
                start = time.perf_counter()
            outputs.append(model(x.to(device)))
        backend.synchronize()
        seconds = (time.perf_counter() - start) / max(len(inputs) - 1, 1)
    return [o.cpu() for o in outputs], seconds


def check_exact(run: Run, check: Check) -> dict[str, float]:
    """Layerwise at depths 1 and 2, copy-bound and compute-bound, bit-equal to resident."""
    import offload_core

    backend, device = run.backend, run.backend.device()
    run.probe.exact_math()
    ratios: dict[str, float] = {}
    mismatches: list[str] = []
    for label, config in run.configs.items():
        model, inputs = _stack(config)
        resident = copy.deepcopy(model).to(device)
        expected, resident_s = _timed_steps(backend, resident, inputs, device)
        del resident
        gc.collect()
        for depth in (1, 2):
            handle = offload_core.enable_offload(model, enable_layerwise_offload=True, prefetch_depth=depth,
                                                 backend=backend)
            try:
                got, offloaded_s = _timed_steps(backend, model, inputs, device)
                stats = handle.stats()
            finally:
                handle.disable()
            key = f"{label} depth {depth}"
            ratios[key] = offloaded_s / resident_s if resident_s else float("nan")
            check.figures[key] = {"step_ratio": ratios[key], "resident_step_s": resident_s,
                                  "offloaded_step_s": offloaded_s, "h2d_bytes_per_step": stats["h2d_bytes"] / STEPS,
                                  "prefetch_misses": stats["prefetch_misses"]}
            bad = [i for i, (a, b) in enumerate(zip(got, expected)) if not torch.equal(a, b)]
            if bad:
                mismatches.append(f"{key}: steps {bad[:5]}")
    check.simulated = run.dry_run
    check.ok = not mismatches
    text = ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items())
    check.summary = (f"{len(run.configs) * 2} runs of {STEPS} steps bit-equal to resident; step time vs resident: {text}"
                     if check.ok else "differs from resident: " + "; ".join(mismatches))
    return ratios


def check_crossover(run: Run, check: Check) -> None:
    """The crossover sweep (ci/gpu_sweep.py): every point bit-equal to resident, and layerwise
    depth 2 within 0.85 of its bound at every point (not judged on the simulator)."""
    points = gpu_sweep.crossover(run.backend, run.probe, run.out, run.sizes, run.bandwidth())
    check.figures = {"h2d_bytes_per_s": run.bandwidth(), "points": points}
    rows = {k: v for k, v in points.items() if "variants" in v}
    inexact = [f"{k} {name}" for k, v in rows.items() for name, r in v["variants"].items() if not r["exact"]]
    slow = [k for k, v in rows.items() if v["variants"]["layerwise depth 2"]["efficiency"] < CROSSOVER_EFFICIENCY]
    # a step faster than its physical bound: the bound's baseline (resident step, plain copy) is too weak
    beyond = [f"{k} {name}" for k, v in rows.items() for name, r in v["variants"].items()
              if r["efficiency"] > BOUND_TOLERANCE]
    check.figures["faster_than_bound"] = beyond
    check.ok = run.judged(check, not slow and not beyond, not inexact)
    worst = min(rows.values(), key=lambda v: v["variants"]["layerwise depth 2"]["efficiency"])
    tokens = sorted({v["tokens"] for v in rows.values()})
    check.summary = (f"{len(rows)} points ({', '.join(map(str, tokens))} tokens), 4 variants each"
                     + (f"; not bit-equal: {', '.join(inexact)}" if inexact else ", bit-equal to resident")
                     + f"; layerwise depth 2 efficiency worst {worst['variants']['layerwise depth 2']['efficiency']:.2f} "
                     f"({worst['model']} at {worst['tokens']} tokens)" + (f"; under {CROSSOVER_EFFICIENCY}: "
                                                                          f"{', '.join(slow)}" if slow else "")
                     + (f"; unreliable (baseline too weak), faster than the bound: {', '.join(beyond)}"
                        if beyond else "")
                     + ("; simulated" if run.dry_run else ""))


#: the share of its bound max(compute, bytes / link) a layerwise depth-2 step must reach
CROSSOVER_EFFICIENCY = 0.85
#: an efficiency above this is a step faster than its physical bound (timing noise allowed for)
BOUND_TOLERANCE = 1.05


def check_host_cost(run: Run, check: Check) -> None:
    """Host cost per block (ci/gpu_sweep.py): offload-core's host time per block above resident's
    at most diffusers' (``use_stream=True, record_stream=True``, its fastest stream path), eager
    and compiled (not judged on the simulator); every variant bit-equal to resident."""
    results = gpu_sweep.host_cost(run.host_backend, run.probe, run.calls, run.out, run.sizes)
    check.figures = results
    over: dict[str, float] = {}
    for mode in ("eager", "regional compile"):
        base = results[f"{mode}, resident"]["host_cpu_us_per_block"]
        ours = results[f"{mode}, offload-core"]["host_cpu_us_per_block"] - base
        theirs = results[f"{mode}, diffusers record_stream=True"]["host_cpu_us_per_block"] - base
        over[mode] = ours / theirs if theirs > 0 else math.inf
        check.figures[f"{mode}: ours over diffusers (record_stream=True), above resident"] = over[mode]
    inexact = [k for k, v in results.items() if isinstance(v, dict) and not v["exact"]]
    check.ok = run.judged(check, all(v <= 1.0 for v in over.values()), not inexact)
    text = "; ".join(
        f"{mode}: resident {results[f'{mode}, resident']['host_cpu_us_per_block']:.0f}, offload-core "
        f"{results[f'{mode}, offload-core']['host_cpu_us_per_block']:.0f}, diffusers "
        f"{results[f'{mode}, diffusers record_stream=False']['host_cpu_us_per_block']:.0f} / "
        f"{results[f'{mode}, diffusers record_stream=True']['host_cpu_us_per_block']:.0f} (record_stream False / True)"
        for mode in ("eager", "regional compile"))
    check.summary = (f"host CPU µs per block: {text}; host synchronisations per block: offload-core "
                     f"{_syncs(results['eager, offload-core']):.2f}, diffusers "
                     f"{_syncs(results['eager, diffusers record_stream=False']):.2f}"
                     + (f"; not bit-equal: {', '.join(inexact)}" if inexact else "")
                     + ("; simulated" if run.dry_run else ""))


def _syncs(result: dict[str, Any]) -> float:
    return sum(result["runtime_calls_per_block"][c] for c in gpu_probe.SYNCHRONISING_CALLS)


def _steady(count: int, run: Run, depth: int = 2):
    """A compute-bound stack offloaded at ``depth`` and ``count`` inputs on the device, warmed up
    by the first two: (model, inputs, handle)."""
    import offload_core

    model, inputs = _stack(run.configs["compute-bound"])
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, prefetch_depth=depth, backend=run.backend)
    device = run.backend.device()
    inputs = [x.to(device) for x in inputs[:count]]
    with torch.no_grad():
        for x in inputs[:2]:
            model(x)
    run.backend.synchronize()
    return model, inputs, handle


def check_overlap(run: Run, check: Check) -> None:
    model, inputs, handle = _steady(6, run)
    try:
        def work():
            with torch.no_grad():
                for x in inputs[2:]:
                    model(x)

        trace = run.probe.profile(work, run.out / "trace-overlap.json")
    finally:
        handle.disable()
    share = trace.copies_under_kernels
    check.figures = trace.summary()
    check.ok = run.judged(check, share >= 0.8, bool(trace.copies))
    check.summary = (f"{share:.0%} of H2D copy time runs concurrently with kernels ({len(trace.copies)} copies, "
                     f"compute-bound){'; simulated' if run.dry_run else ''}")


#: host synchronisations per steady-state forward that docs/design.md ("Threads and streams") allows:
#: ordering by events only; the host waits for the copy stream once, at the end of a forward, before
#: host memory the copies read may change
SYNCS_PER_FORWARD = {"cudaStreamSynchronize": 1, "cudaEventSynchronize": 0, "cudaDeviceSynchronize": 0}


def check_syncs(run: Run, check: Check) -> None:
    """Every host synchronisation through the backend (device, stream and event), per
    steady-state forward of layerwise at depths 1 and 2, outside and inside ``frozen()``."""
    import offload_core

    model, inputs = _stack(run.configs["copy-bound"])
    device = run.backend.device()
    inputs = [x.to(device) for x in inputs[:6]]
    bad = []
    for depth in (1, 2):
        for frozen in (False, True):
            handle = offload_core.enable_offload(model, enable_layerwise_offload=True, prefetch_depth=depth,
                                                 backend=run.backend)
            try:
                with torch.no_grad(), (handle.frozen() if frozen else contextlib.nullcontext()):
                    for x in inputs[:2]:
                        model(x)
                    since = len(run.calls.log)
                    for x in inputs[2:]:
                        model(x)
                    counts = run.calls.counts(since)
            finally:
                handle.disable()
            key = f"depth {depth}{' in frozen()' if frozen else ''}"
            per = {name: counts.get(name, 0) / len(inputs[2:]) for name in SYNCS_PER_FORWARD}
            check.figures[key] = per
            if per != SYNCS_PER_FORWARD:
                bad.append(key)
    check.ok = not bad
    text = ", ".join(f"{k}: {sum(v.values()):g}" for k, v in check.figures.items())
    check.summary = (f"host synchronisations per steady-state forward, counted at the backend: {text} "
                     f"(the pass-end copy-stream synchronize)" + (f"; other than the design's: {', '.join(bad)}"
                                                                  if bad else ""))


def check_bandwidth(run: Run, check: Check, exact: dict[str, Any]) -> None:
    memcpy = run.bandwidth()
    copy_bound = exact["copy-bound depth 2"]
    achieved = copy_bound["h2d_bytes_per_step"] / copy_bound["offloaded_step_s"]
    check.figures = {"memcpy_bytes_per_s": memcpy, "achieved_bytes_per_s": achieved, "ratio": achieved / memcpy}
    check.ok = run.judged(check, achieved / memcpy >= 0.9)
    check.summary = (f"layerwise copy-bound depth 2 moves {achieved / 1e9:.2f} GB/s, "
                     f"{achieved / memcpy:.0%} of a plain pinned copy ({memcpy / 1e9:.2f} GB/s)"
                     + ("; simulated" if run.dry_run else ""))


def check_host_memory(run: Run, check: Check) -> None:
    """``stats()["pinned_host_bytes"]`` against the backend's own count of what it pinned (its
    registrations where it registers homes, the caching allocator's rounding otherwise), over two
    enable/disable cycles; ``VmPin`` and ``VmLck`` of the process beside it."""
    import offload_core

    backend = run.backend
    model, inputs = _stack(run.configs["copy-bound"])
    backend.empty_host_cache()  # pinned blocks cached by earlier checks would be reused, not allocated
    baseline, locked = backend.pinned_memory_allocated(), gpu_host.proc_status("VmPin", "VmLck")
    cycles = []
    for _ in range(2):
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
        with torch.no_grad():
            model(inputs[0].to(backend.device()))
        reported, counted = handle.stats()["pinned_host_bytes"], backend.pinned_memory_allocated() - baseline
        held = gpu_host.proc_status("VmPin", "VmLck")
        handle.disable()
        left = backend.pinned_memory_allocated() - baseline
        cycles.append({"reported": reported, "backend": counted, "after_disable": left,
                       **{f"{k}_delta": (held[k] - locked[k]) if held[k] is not None and locked[k] is not None else None
                          for k in held}})
    check.figures = {"cycles": cycles, "registers_homes": offload_core.Capability.HOST_REGISTER in backend.capabilities}
    check.ok = all(c["reported"] == c["backend"] > 0 and c["after_disable"] == 0 for c in cycles)
    check.summary = "; ".join(
        f"stats {c['reported'] / 2**20:.2f} MiB vs the backend's count {c['backend'] / 2**20:.2f} MiB "
        f"(VmPin {_mib(c['VmPin_delta'])}, VmLck {_mib(c['VmLck_delta'])}), {c['after_disable'] / 2**20:.2f} MiB left "
        "after disable" for c in cycles)


def _mib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**20:+.2f} MiB"


def check_mem_get_info(run: Run, check: Check) -> None:
    backend, probe = run.backend, run.probe
    unit = 1 << 20 if not run.dry_run else 1 << 10
    keep = backend.empty_device(256 * unit)
    idle = backend.empty_device(512 * unit)
    del idle  # cached by the allocator: driver-used, free to new allocations
    free, total = backend.mem_get_info()
    driver_free, driver_total = probe.driver_mem_get_info()
    reserve = probe.allocator_idle_reserve()
    del keep
    check.figures = {"backend_free": free, "driver_free": driver_free, "idle_reserve": reserve, "total": total}
    check.ok = total == driver_total and free == driver_free + reserve and reserve >= 512 * unit
    check.simulated = run.dry_run
    check.summary = (f"backend free {free / 2**30:.3f} GiB = driver free {driver_free / 2**30:.3f} GiB "
                     f"+ allocator's idle reserve {reserve / 2**20:.2f} MiB; total {total / 2**30:.1f} GiB")


def check_near_capacity(run: Run, check: Check) -> None:
    """Two model-level groups, and activations in the first group's forward, on a device filled
    so that room for about three groups stays free: prefetching must never push a forward into
    an out-of-memory error."""
    from offload_core.strategies.model_level import ModelLevelOffload
    from offload_core.common.transaction import Transaction

    backend, probe = run.probe.capacity()
    device = backend.device()
    d = 8192 if not run.dry_run else 128  # a layer of d x d float32; a group is 10 of them
    layer = d * d * 4
    room, scratch = 32 * layer, 12 * layer  # 8 GiB and 3 GiB on the device
    probe.empty_cache()
    free, _ = backend.mem_get_info()
    ballast = backend.empty_device(max(free - room, 0))
    groups = [nn.Sequential(*(nn.Linear(d, d, bias=False) for _ in range(10))).eval() for _ in range(2)]

    def activations(module, args, output):  # taken and given back inside group 0's forward
        taken = backend.empty_device(scratch)
        del taken

    groups[0][-1].register_forward_hook(activations)
    part = ModelLevelOffload([(f"group{i}", [(f"group{i}", g)]) for i, g in enumerate(groups)], backend)
    before = probe.allocator_counters()
    try:
        with Transaction() as txn:
            part.enable(txn)
        x = torch.randn(4096 if not run.dry_run else 16, d, device=device)
        with torch.no_grad():
            for _ in range(3):
                groups[1](groups[0](x))
                part.release_all()
        backend.synchronize()
    except torch.OutOfMemoryError as exc:
        check.figures["error"] = str(exc).splitlines()[0]
    finally:
        part.disable()
        del ballast
        probe.empty_cache()
    after = probe.allocator_counters()
    retries = None if after["num_alloc_retries"] is None else after["num_alloc_retries"] - before["num_alloc_retries"]
    ooms = after["num_ooms"] - before["num_ooms"]
    check.figures.update({"num_alloc_retries": retries, "num_ooms": ooms, "free_bytes": room,
                          "loads": part.counters.loads})
    check.ok = ooms == 0 and "error" not in check.figures
    check.simulated = run.dry_run
    check.summary = (f"3 calls of 2 groups of {10 * layer / 2**30:.3g} GiB, {scratch / 2**30:.3g} GiB of activations, "
                     f"{room / 2**30:.3g} GiB free: {ooms} OOMs, {'n/a' if retries is None else retries} allocator "
                     f"retries, {part.counters.loads} group loads" + (f"; {check.figures['error']}"
                                                                      if "error" in check.figures else ""))


def check_stream_switches(run: Run, check: Check) -> None:
    """Stream contexts the backend enters per block of a steady-state forward (the backend's own
    count), blocks of two dtypes: layerwise at depths 1 and 2, and model-level per group load; at
    most one each."""
    import offload_core

    backend = run.backend
    if backend.stream_switches is None:
        check.ok, check.summary = False, f"backend {backend.name!r} does not count its stream switches"
        return
    model, inputs = _stack(run.configs["copy-bound"])
    for block in model.blocks:  # a second dtype per block: two copies a block, one stream switch
        block.register_buffer("scale", torch.ones(block.up.in_features, dtype=torch.bfloat16))
    device = backend.device()
    blocks = len(model.blocks)
    runs = [(f"layerwise depth {d}", {"enable_layerwise_offload": True, "prefetch_depth": d}) for d in (1, 2)]
    runs.append(("model-level", {"enable_cpu_offload": True}))
    bad = []
    for key, options in runs:
        handle = offload_core.enable_offload(model, backend=backend, **options)
        try:
            with torch.no_grad():
                model(inputs[0].to(device))  # warm-up
                switches, loads = backend.stream_switches, handle.stats()["loads"]
                for x in inputs[1:4]:
                    model(x.to(device))
            backend.synchronize()
            switches = (backend.stream_switches - switches) / 3
            loads = (handle.stats()["loads"] - loads) / 3
        finally:
            handle.disable()
        per = blocks if key.startswith("layerwise") else loads
        check.figures[key] = {"switches_per_forward": switches, "loads_per_forward": loads,
                              "switches_per_block": switches / per if per else float("nan")}
        if switches > per:
            bad.append(key)
    check.ok = not bad
    text = ", ".join(f"{k} {v['switches_per_block']:.2f}" for k, v in check.figures.items())
    check.summary = f"stream switches per block (model-level: per group load): {text}" + (
        f"; more than one: {', '.join(bad)}" if bad else "")


def _h2d_seconds(backend, src: torch.Tensor, dst: torch.Tensor) -> float:
    """The fastest of three copies of ``src`` into ``dst``, timed on the device where the backend
    has timing events, else on the host."""
    from offload_core import Capability

    timing = Capability.TIMING in backend.capabilities
    stream = backend.new_stream()
    best = float("inf")
    for _ in range(3):
        start, end = backend.new_event(timing=timing), backend.new_event(timing=timing)
        host_start = time.perf_counter()
        start.record(stream)
        backend.copy_async(dst, src, stream)
        end.record(stream)
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 if timing else time.perf_counter() - host_start)
    return best


def check_registered_bandwidth(run: Run, check: Check) -> None:
    """H2D bandwidth from registered pinned memory against the caching host allocator's."""
    from offload_core import Capability
    from offload_core.hostmem.registered import RegisteredMemory

    backend = run.backend
    nbytes = 1 << 20 if run.dry_run else 1 << 30
    if Capability.HOST_REGISTER not in backend.capabilities:
        check.ok, check.summary = False, f"backend {backend.name!r} lists no {Capability.HOST_REGISTER!r} capability"
        return
    cached = run.probe.cached_pinned(nbytes)
    dst = backend.empty_device(nbytes)
    memory = RegisteredMemory(backend)  # what offload-core pins homes with on this backend
    registered = memory.allocate(nbytes)
    try:
        seconds = {"registered": _h2d_seconds(backend, registered, dst),
                   "caching allocator": _h2d_seconds(backend, cached, dst)}
    finally:
        del registered, cached, dst
        memory.close()
        backend.empty_host_cache()
    rates = {k: nbytes / v for k, v in seconds.items()}
    check.figures = {f"{k}_bytes_per_s": v for k, v in rates.items()}
    check.figures["ratio"] = rates["registered"] / rates["caching allocator"]
    check.ok = run.judged(check, check.figures["ratio"] >= 0.9)
    check.summary = (f"registered pinned {rates['registered'] / 1e9:.2f} GB/s, caching allocator's pinned "
                     f"{rates['caching allocator'] / 1e9:.2f} GB/s (x{check.figures['ratio']:.2f})"
                     + ("; simulated" if run.dry_run else ""))


CHECKS: list[tuple[str, str]] = [
    ("exact", "bit-equal to resident, fp32, TF32 off"),
    ("crossover", f"bit-equal; layerwise depth 2 >= {CROSSOVER_EFFICIENCY} of max(compute, bytes / pinned H2D), "
                  "1k to 64k tokens"),
    ("host cost per block", "ours above resident <= diffusers (use_stream, record_stream=True) above resident"),
    ("overlap", ">= 80% of H2D time under kernels (compute-bound)"),
    ("host syncs", "per forward: 1 copy-stream synchronize (docs/design.md), no event or device synchronize"),
    ("H2D bandwidth", ">= 90% of a plain pinned copy (copy-bound)"),
    ("pinned accounting", "stats() == the backend's pinned count, 0 after disable, 2 cycles"),
    ("mem_get_info", "driver free + idle reserve"),
    ("model-level near capacity", "0 OOMs, retries reported"),
    ("stream switches", "<= 1 per block (layerwise depth 1 and 2), per group load (model-level)"),
    ("registered pinned H2D", ">= 90% of the caching allocator's pinned copy"),
]


def hardware(dry_run: bool, out: Path) -> list[Check]:
    run = Run(dry_run, out)
    checks = {name: Check(name, target) for name, target in CHECKS}
    exact: dict[str, Any] = {}

    def first() -> None:
        check_exact(run, checks["exact"])
        exact.update(checks["exact"].figures)

    runs: dict[str, Callable[[], None]] = {
        "exact": first,
        "crossover": lambda: check_crossover(run, checks["crossover"]),
        "host cost per block": lambda: check_host_cost(run, checks["host cost per block"]),
        "overlap": lambda: check_overlap(run, checks["overlap"]),
        "host syncs": lambda: check_syncs(run, checks["host syncs"]),
        "H2D bandwidth": lambda: check_bandwidth(run, checks["H2D bandwidth"], exact),
        "pinned accounting": lambda: check_host_memory(run, checks["pinned accounting"]),
        "mem_get_info": lambda: check_mem_get_info(run, checks["mem_get_info"]),
        "model-level near capacity": lambda: check_near_capacity(run, checks["model-level near capacity"]),
        "stream switches": lambda: check_stream_switches(run, checks["stream switches"]),
        "registered pinned H2D": lambda: check_registered_bandwidth(run, checks["registered pinned H2D"]),
    }
    for name, check in checks.items():
        start = time.perf_counter()
        try:
            runs[name]()
        except Exception as exc:  # noqa: BLE001 - one check's failure is its line, not the run's end
            check.ok, check.summary = False, f"{type(exc).__name__}: {exc}"
        check.figures["seconds"] = time.perf_counter() - start
        check.simulated = dry_run
        print(check.line(), flush=True)
    return list(checks.values())


# -- environment ---------------------------------------------------------------------------------


def environment(dry_run: bool, site: str) -> dict[str, Any]:
    import offload_core
    from offload_core.device import collectives as offload_dist
    from offload_core_cuda import CudaBackend

    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    facts: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_runtime": torch.version.cuda,
        "device": torch.cuda.get_device_name(0) if cuda else None,
        "capability": list(torch.cuda.get_device_capability(0)) if cuda else None,
        "offload_core": offload_core.__file__,
        "host_cache_api": ("torch._C._host_emptyCache" if hasattr(torch._C, "_host_emptyCache")
                           else "torch.accelerator.empty_host_cache"
                           if hasattr(getattr(torch, "accelerator", None), "empty_host_cache") else None),
        "compiler_disable": str(inspect.signature(torch.compiler.disable)),
        "all_gather": next((n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)),
                           "all_gather (list)"),
        "cuda_backend_host_cache": None,
    }
    if cuda:
        emptier = CudaBackend().host_cache_emptier()
        facts["cuda_backend_host_cache"] = getattr(emptier, "__qualname__", repr(emptier))
    backend = offload_core.get_backend("fake" if dry_run else "cuda") if dry_run or cuda else None
    facts["link"] = gpu_host.link_facts(dry_run, backend)
    facts["from_wheel"] = Path(offload_core.__file__).resolve().is_relative_to(Path(site).resolve())
    facts["ok"] = facts["from_wheel"] and (dry_run or cuda)
    _ = offload_dist  # imported: the module the all-gather goes through must import on this torch
    return facts


# -- what it costs on an H200 -------------------------------------------------------------------------

#: seconds of the steps that are not sized by their work: installing the carried wheels, the
#: environment, the conformance kit and the strategy tests (pytest's and CUDA's start-up, and 120
#: small tests bound by the host; their dry run took 17, 6, 17 and 33 s on 2 loaded cores, the
#: simulator's chaos delays included; CUDA's start-up and the first kernels' loading added)
FIXED_SECONDS = {"install": 15.0, "environment": 5.0, "kit": 20.0, "strategies": 40.0}
#: seconds of the hardware checks not sized below: overlap, host syncs, bandwidth, pinned
#: accounting, mem_get_info, near capacity, stream switches, registered H2D (1 GiB copies, two
#: 2.5 GiB groups moved three times, a few enables of a 1 GiB stack)
OTHER_CHECKS_SECONDS = 10.0


def estimate() -> dict[str, float]:
    """The check's seconds on an H200, step by step, from the work it does (``gpu_sweep``'s
    assumptions of the device: :data:`gpu_sweep.H200_FLOPS`, :data:`gpu_sweep.H200_H2D`)."""
    flops, link = gpu_sweep.H200_FLOPS, gpu_sweep.H200_H2D
    seconds = dict(FIXED_SECONDS)
    # exact: per config, 20 steps resident and at two depths, fp32 without TF32 (a sixteenth of bf16's rate)
    exact = 0.0
    for d, hidden, blocks, tokens in CONFIGS.values():
        compute = blocks * 4 * d * hidden * tokens / (flops / 16)
        copy_s = blocks * 2 * d * hidden * 4 / link
        exact += STEPS * (compute + 2 * max(compute, copy_s))
    sweeps = gpu_sweep.estimate_seconds(gpu_sweep.GPU)
    seconds["hardware"] = exact + sum(sweeps.values()) + OTHER_CHECKS_SECONDS
    # realsize: Wan2.1-1.3B at 32760 tokens, 4 steps of two calls, five variants (compute-bound)
    tokens, dim, blocks = 21 * 30 * 52, 1536, 30
    call = blocks * gpu_sweep.block_flops("wan", {"dim": dim, "ffn_dim": 8960}, tokens, 512) / flops
    seconds["realsize"] = 5 * 4 * 2 * call + 20.0  # 20 s: building and pinning 2.8 GB, twice
    seconds["total"] = sum(seconds.values())
    return seconds


# -- the table -----------------------------------------------------------------------------------

STEP_TITLES = {"install": "offline install (carried wheels)", "environment": "environment",
               "kit": "conformance kit", "strategies": "strategy tests", "hardware": "hardware checks",
               "realsize": "Wan2.1-1.3B real size, pipeline call pattern"}


def _state(ok: bool | None) -> str:
    return "not run" if ok is None else "pass" if ok else "FAIL"


def table(report: dict[str, Any]) -> str:
    rows = ["| step / check | result | details |", "|---|---|---|"]
    for name, step in report["steps"].items():
        result = step.get("result") or {}
        title = STEP_TITLES.get(name, name)
        if name in ("kit", "strategies") and result:
            detail = f"{result['passed']} passed, {result['failures'] + result['errors']} failed, {result['skipped']} skipped"
        elif name == "environment" and result:
            link = result.get("link") or {}
            detail = (f"torch {result['torch']} (CUDA {result['cuda_runtime']}), {result['device'] or 'no GPU'}; "
                      f"PCIe gen {link.get('pcie_generation') or 'n/a'} x{link.get('pcie_width') or 'n/a'}, "
                      f"GPU NUMA node {_or_na(link.get('gpu_numa_node'))}, homes on node "
                      f"{_or_na(link.get('home_numa_node'))}; host cache: {result['host_cache_api']}; "
                      f"compiler.disable{result['compiler_disable']}")
        elif name == "realsize" and result:
            variants = result.get("variants", {})
            detail = ", ".join(f"{k} x{v['ratio_to_resident']:.2f}" for k, v in variants.items() if k != "resident")
        else:
            detail = f"exit status {step['exit_status']}"
        rows.append(f"| {title} | {_state(step['ok'])} | {detail} ({step['seconds']:.0f} s) |")
        if name == "hardware" and result:
            rows += [f"| &nbsp; {c['name']} | {_state(c['ok'])} | {c['summary']} (target: {c['target']}) |"
                     for c in result["checks"]]
    verdict = "all passed" if report["ok"] else "FAILED"
    kind = "dry run on the fake backend (no GPU): figures simulated" if report["dry_run"] else "GPU run"
    estimate_s = ((report["steps"].get("hardware") or {}).get("result") or {}).get("estimate_h200_s", {}).get("total")
    estimated = f"; estimated on an H200 from its work: {estimate_s:.0f} s" if estimate_s else ""
    return (f"# gpu-check: {verdict} ({kind}, {report['seconds']:.0f} s{estimated})\n\n" + "\n".join(rows)
            + "\n")


def _or_na(value: Any) -> str:
    return "n/a" if value is None else str(value)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="ci/gpu_check.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("environment")
    env.add_argument("--out", required=True, type=Path)
    env.add_argument("--site", required=True, help="where the wheels were installed")
    env.add_argument("--dry-run", action="store_true")
    hw = sub.add_parser("hardware")
    hw.add_argument("--out", required=True, type=Path)
    hw.add_argument("--dry-run", action="store_true")
    tab = sub.add_parser("table")
    tab.add_argument("--report", required=True, type=Path)
    tab.add_argument("--out", required=True, type=Path)
    sub.add_parser("estimate")
    args = parser.parse_args(argv)
    if args.command == "environment":
        facts = environment(args.dry_run, args.site)
        args.out.write_text(json.dumps(facts, indent=1))
        print(f"gpu-check: {_state(facts['ok'])}: environment: " + json.dumps(facts), flush=True)
        return 0 if facts["ok"] else 1
    if args.command == "hardware":
        checks = hardware(args.dry_run, args.out.parent)
        args.out.write_text(json.dumps({"dry_run": args.dry_run, "estimate_h200_s": estimate(),
                                        "checks": [c.as_dict() for c in checks]}, indent=1))
        return 0 if all(c.ok for c in checks) else 1
    if args.command == "estimate":
        print(json.dumps(estimate(), indent=1))
        return 0
    text = table(json.loads(args.report.read_text()))
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
