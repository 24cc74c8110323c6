"""The hardware checks of ci/gpu-check.sh, and its final table.

Subcommands (run by the script, with offload-core imported from the wheel it installed):

* ``environment --out FILE.json``: torch, CUDA, device, and which of the APIs that differ between
  torch versions this torch has (host-cache emptying, ``compiler.disable``'s ``reason=``, the
  all-gather); fails if offload-core is not the installed wheel, or (not a dry run) no GPU.
* ``hardware --out FILE.json [--dry-run]``: the checks that need a device, in order; each is one
  pass/fail line. With ``--dry-run`` the backend-generic ones (exactness, stream switches per
  block, registered pinned bandwidth: "not available" where the backend lacks the capability) run
  on the fake backend at tiny sizes and the CUDA-only ones print "skipped: no GPU".
* ``table --report FILE.json --out FILE.md``: the table a user reads, from the script's JSON report.

This file is the check, not the core: it may call ``torch.cuda``.
"""

from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

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
    """One line of the report: ``ok`` is True, False, or None (skipped), with the figures."""

    def __init__(self, name: str, target: str) -> None:
        self.name, self.target = name, target
        self.ok: bool | None = None
        self.summary = ""
        self.figures: dict[str, Any] = {}

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "target": self.target, "summary": self.summary,
                "figures": self.figures}

    def line(self) -> str:
        state = "skipped" if self.ok is None else "pass" if self.ok else "FAIL"
        return f"gpu-check: {state}: {self.name}: {self.summary}"


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


def check_exact(backend, configs, check: Check) -> dict[str, float]:
    """Layerwise at depths 1 and 2, copy-bound and compute-bound, bit-equal to resident."""
    import offload_core

    device = backend.device()
    ratios: dict[str, float] = {}
    mismatches: list[str] = []
    for label, config in configs.items():
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
    check.ok = not mismatches
    text = ", ".join(f"{k} x{v:.2f}" for k, v in ratios.items())
    check.summary = (f"{len(configs) * 2} runs of {STEPS} steps bit-equal to resident; step time vs resident: {text}"
                     if check.ok else "differs from resident: " + "; ".join(mismatches))
    return ratios


def _profile(fn: Callable[[], None]):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return prof


def _intervals(events, keep: Callable[[str], bool]) -> list[tuple[float, float]]:
    return sorted((e.time_range.start, e.time_range.end) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA and keep(e.name))


def _covered(spans: list[tuple[float, float]], by: list[tuple[float, float]]) -> float:
    """Share of the total length of ``spans`` that lies inside the union of ``by``."""
    merged: list[list[float]] = []
    for start, end in by:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = sum(end - start for start, end in spans)
    inside = sum(max(0.0, min(end, m_end) - max(start, m_start))
                 for start, end in spans for m_start, m_end in merged)
    return inside / total if total else 0.0


def _steady(count: int, backend, depth: int = 2):
    """A compute-bound stack offloaded at ``depth`` and ``count`` inputs on the device, warmed up
    by the first two: (model, inputs, handle)."""
    import offload_core

    model, inputs = _stack(CONFIGS["compute-bound"])
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, prefetch_depth=depth, backend=backend)
    device = backend.device()
    inputs = [x.to(device) for x in inputs[:count]]
    with torch.no_grad():
        for x in inputs[:2]:
            model(x)
    backend.synchronize()
    return model, inputs, handle


def check_overlap(backend, check: Check) -> None:
    model, inputs, handle = _steady(6, backend)
    try:
        def run():
            with torch.no_grad():
                for x in inputs[2:]:
                    model(x)

        prof = _profile(run)
    finally:
        handle.disable()
    events = prof.events()
    copies = _intervals(events, lambda n: "HtoD" in n)
    kernels = _intervals(events, lambda n: "Memcpy" not in n and "Memset" not in n)
    share = _covered(copies, kernels)
    check.figures = {"h2d_copies": len(copies), "kernels": len(kernels), "h2d_time_under_kernels": share}
    check.ok = bool(copies) and share >= 0.8
    check.summary = f"{share:.0%} of H2D copy time runs concurrently with kernels ({len(copies)} copies, compute-bound)"


def check_syncs(backend, check: Check) -> None:
    model, inputs, handle = _steady(6, backend)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with torch.no_grad():
                    for x in inputs[2:]:
                        model(x)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        backend.synchronize()
    finally:
        handle.disable()
    syncing = [str(w.message) for w in caught if "synchroniz" in str(w.message).lower()]
    per_forward = len(syncing) / len(inputs[2:])
    check.figures = {"syncs_per_forward": per_forward, "first": syncing[:3]}
    check.ok = per_forward == 0
    check.summary = f"{per_forward:g} synchronising calls per steady-state forward"


def check_bandwidth(backend, check: Check, exact: dict[str, Any]) -> None:
    nbytes = 1 << 30
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=backend.device())
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    del src, dst
    backend.empty_host_cache()  # the freed pinned block would be reused by the next check's slabs
    memcpy = nbytes / best
    copy_bound = exact["copy-bound depth 2"]
    achieved = copy_bound["h2d_bytes_per_step"] / copy_bound["offloaded_step_s"]
    check.figures = {"memcpy_bytes_per_s": memcpy, "achieved_bytes_per_s": achieved, "ratio": achieved / memcpy}
    check.ok = achieved / memcpy >= 0.9
    check.summary = (f"layerwise copy-bound depth 2 moves {achieved / 1e9:.1f} GB/s, "
                     f"{achieved / memcpy:.0%} of a plain pinned copy ({memcpy / 1e9:.1f} GB/s)")


def check_host_memory(backend, check: Check) -> None:
    import offload_core

    if not hasattr(torch.cuda, "host_memory_stats"):
        check.summary = "skipped: torch.cuda.host_memory_stats is new in torch 2.7"
        return

    def held() -> int:
        return int(torch.cuda.host_memory_stats().get("allocated_bytes.current", 0))

    model, inputs = _stack(CONFIGS["copy-bound"])
    backend.empty_host_cache()  # pinned blocks cached by earlier checks would be reused, not allocated
    baseline = held()
    cycles = []
    for _ in range(2):
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
        with torch.no_grad():
            model(inputs[0].to(backend.device()))
        reported, allocator = handle.stats()["pinned_host_bytes"], held() - baseline
        handle.disable()
        cycles.append({"reported": reported, "allocator": allocator, "after_disable": held() - baseline})
    check.figures = {"cycles": cycles}
    check.ok = all(c["reported"] == c["allocator"] and c["after_disable"] == 0 for c in cycles)
    check.summary = "; ".join(f"stats {c['reported'] / 2**20:.1f} MiB vs host allocator {c['allocator'] / 2**20:.1f} MiB, "
                              f"{c['after_disable'] / 2**20:.1f} MiB left after disable" for c in cycles)


def check_mem_get_info(backend, check: Check) -> None:
    device = backend.device()
    keep = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    idle = torch.empty(512 << 20, dtype=torch.uint8, device=device)
    del idle  # cached by the allocator: driver-used, free to new allocations
    free, total = backend.mem_get_info()
    driver_free, driver_total = torch.cuda.mem_get_info(device)
    reserve = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    del keep
    check.figures = {"backend_free": free, "driver_free": driver_free, "idle_reserve": reserve, "total": total}
    check.ok = total == driver_total and free == driver_free + reserve and reserve >= 512 << 20
    check.summary = (f"backend free {free / 2**30:.2f} GiB = driver free {driver_free / 2**30:.2f} GiB "
                     f"+ allocator's idle reserve {reserve / 2**30:.2f} GiB; total {total / 2**30:.1f} GiB")


def check_near_capacity(backend, check: Check) -> None:
    """Two model-level groups, and activations in the first group's forward, on a device filled
    so that 8 GiB stay free: prefetching must never push a forward into an out-of-memory error."""
    from offload_core.transaction import Transaction
    from offload_core.strategies.model_level import ModelLevelOffload

    device = backend.device()
    room = 8 << 30
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info(device)
    ballast = torch.empty(max(free - room, 0), dtype=torch.uint8, device=device)
    d = 8192  # a 256 MiB float32 layer; a group is 10 of them: 2.5 GiB
    groups = [nn.Sequential(*(nn.Linear(d, d, bias=False) for _ in range(10))).eval() for _ in range(2)]

    def activations(module, args, output):  # 3 GiB taken and given back inside group 0's forward
        scratch = torch.empty(3 << 30, dtype=torch.uint8, device=device)
        del scratch

    groups[0][-1].register_forward_hook(activations)
    part = ModelLevelOffload([(f"group{i}", [(f"group{i}", g)]) for i, g in enumerate(groups)], backend)
    before = torch.cuda.memory_stats(device)
    try:
        with Transaction() as txn:
            part.enable(txn)
        x = torch.randn(4096, d, device=device)
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
        torch.cuda.empty_cache()
    after = torch.cuda.memory_stats(device)
    retries = after.get("num_alloc_retries", 0) - before.get("num_alloc_retries", 0)
    ooms = after.get("num_ooms", 0) - before.get("num_ooms", 0)
    check.figures.update({"num_alloc_retries": retries, "num_ooms": ooms, "free_bytes": room,
                          "loads": part.counters.loads})
    check.ok = ooms == 0 and "error" not in check.figures
    check.summary = (f"3 calls of 2 groups of 2.5 GiB, 3 GiB of activations, 8 GiB free: {ooms} OOMs, "
                     f"{retries} allocator retries, {part.counters.loads} group loads")


def check_stream_switches(backend, configs, check: Check) -> None:
    """Stream contexts the backend enters per block of a steady-state forward (the backend's own
    count), blocks of two dtypes: layerwise at depths 1 and 2, and model-level per group load; at
    most one each."""
    import offload_core

    if backend.stream_switches is None:
        check.summary = f"not available: backend {backend.name!r} does not count its stream switches"
        return
    model, inputs = _stack(configs["copy-bound"])
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


def check_registered_bandwidth(backend, check: Check, nbytes: int = 1 << 30) -> None:
    """H2D bandwidth from registered pinned memory against the caching host allocator's."""
    from offload_core import Capability
    from offload_core.hostmem.registered import RegisteredMemory

    if Capability.HOST_REGISTER not in backend.capabilities:
        check.summary = f"not available: backend {backend.name!r} lists no {Capability.HOST_REGISTER!r} capability"
        return
    try:
        cached = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    except RuntimeError as exc:  # no accelerator torch knows of (a simulator)
        check.summary = f"not available: no caching host allocator to compare with ({exc})"
        return
    dst = backend.empty_device(nbytes)
    memory = RegisteredMemory(backend)  # what offload-core pins homes with on this backend
    registered = memory.allocate(nbytes)
    try:
        seconds = {"registered": _h2d_seconds(backend, registered, dst), "caching allocator": _h2d_seconds(backend, cached, dst)}
    finally:
        del registered, cached, dst
        memory.close()
        backend.empty_host_cache()
    rates = {k: nbytes / v for k, v in seconds.items()}
    check.figures = {f"{k}_bytes_per_s": v for k, v in rates.items()}
    check.figures["ratio"] = rates["registered"] / rates["caching allocator"]
    check.ok = check.figures["ratio"] >= 0.9
    check.summary = (f"registered pinned {rates['registered'] / 1e9:.1f} GB/s, caching allocator's pinned "
                     f"{rates['caching allocator'] / 1e9:.1f} GB/s (x{check.figures['ratio']:.2f})")


def hardware(dry_run: bool) -> list[Check]:
    import offload_core

    backend = offload_core.get_backend("fake" if dry_run else "cuda", **({"chaos": True} if dry_run else {}))
    if not dry_run:
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as on the host: bit-equality is meaningful
        torch.backends.cudnn.allow_tf32 = False
    checks = [
        Check("exact", "bit-equal to resident, fp32, TF32 off"),
        Check("overlap", ">= 80% of H2D time under kernels (compute-bound)"),
        Check("host syncs", "0 per steady-state forward"),
        Check("H2D bandwidth", ">= 90% of a plain pinned copy (copy-bound)"),
        Check("pinned accounting", "stats() == host allocator, 0 after disable, 2 cycles"),
        Check("mem_get_info", "driver free + idle reserve"),
        Check("model-level near capacity", "0 OOMs, retries reported"),
        Check("stream switches", "<= 1 per block (layerwise depth 1 and 2), per group load (model-level)"),
        Check("registered pinned H2D", ">= 90% of the caching allocator's pinned copy"),
    ]
    exact, configs = checks[0], TINY_CONFIGS if dry_run else CONFIGS
    try:
        check_exact(backend, configs, exact)
    except Exception as exc:  # noqa: BLE001 - reported as this check's failure; the others still run
        exact.ok, exact.summary = False, f"{type(exc).__name__}: {exc}"
    print(exact.line(), flush=True)
    # (check, run, whether it needs CUDA): the backend-generic ones run on the fake in a dry run too
    runs: list[tuple[Check, Callable[[], None], bool]] = [
        (checks[1], lambda: check_overlap(backend, checks[1]), True),
        (checks[2], lambda: check_syncs(backend, checks[2]), True),
        (checks[3], lambda: check_bandwidth(backend, checks[3], exact.figures), True),
        (checks[4], lambda: check_host_memory(backend, checks[4]), True),
        (checks[5], lambda: check_mem_get_info(backend, checks[5]), True),
        (checks[6], lambda: check_near_capacity(backend, checks[6]), True),
        (checks[7], lambda: check_stream_switches(backend, configs, checks[7]), False),
        (checks[8], lambda: check_registered_bandwidth(backend, checks[8], 1 << 20 if dry_run else 1 << 30), False),
    ]
    for check, run, needs_cuda in runs:
        if dry_run and needs_cuda:
            check.summary = "skipped: no GPU"
        else:
            try:
                run()
            except Exception as exc:  # noqa: BLE001 - one check's failure is its line, not the run's end
                check.ok, check.summary = False, f"{type(exc).__name__}: {exc}"
        print(check.line(), flush=True)
    return checks


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
    facts["from_wheel"] = Path(offload_core.__file__).resolve().is_relative_to(Path(site).resolve())
    facts["ok"] = facts["from_wheel"] and (dry_run or cuda)
    _ = offload_dist  # imported: the module the all-gather goes through must import on this torch
    return facts


# -- the table -----------------------------------------------------------------------------------

STEP_TITLES = {"install": "offline install (carried wheels)", "environment": "environment",
               "kit": "conformance kit", "strategies": "strategy tests", "hardware": "hardware checks",
               "realsize": "Wan2.1-1.3B real size"}


def _state(ok: bool | None) -> str:
    return "skipped" if ok is None else "pass" if ok else "FAIL"


def table(report: dict[str, Any]) -> str:
    rows = ["| step / check | result | details |", "|---|---|---|"]
    for name, step in report["steps"].items():
        result = step.get("result") or {}
        title = STEP_TITLES.get(name, name)
        if name in ("kit", "strategies") and result:
            detail = f"{result['passed']} passed, {result['failures'] + result['errors']} failed, {result['skipped']} skipped"
        elif name == "environment" and result:
            detail = (f"torch {result['torch']} (CUDA {result['cuda_runtime']}), {result['device'] or 'no GPU'}; "
                      f"host cache: {result['host_cache_api']}; compiler.disable{result['compiler_disable']}")
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
    kind = "dry run on the fake backend (no GPU)" if report["dry_run"] else "GPU run"
    return f"# gpu-check: {verdict} ({kind}, {report['seconds']:.0f} s)\n\n" + "\n".join(rows) + "\n"


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
    args = parser.parse_args(argv)
    if args.command == "environment":
        facts = environment(args.dry_run, args.site)
        args.out.write_text(json.dumps(facts, indent=1))
        print(f"gpu-check: {_state(facts['ok'])}: environment: " + json.dumps(facts), flush=True)
        return 0 if facts["ok"] else 1
    if args.command == "hardware":
        checks = hardware(args.dry_run)
        args.out.write_text(json.dumps({"checks": [c.as_dict() for c in checks]}, indent=1))
        return 0 if all(c.ok is not False for c in checks) else 1
    text = table(json.loads(args.report.read_text()))
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
