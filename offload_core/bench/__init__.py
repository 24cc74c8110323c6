"""Benchmarks behind ``offload-core bench``: every figure is a ratio measured in one run, the
variants interleaved, with its spread over the repetitions (docs/benchmarks.md). Timed tests
would be flaky; these report, and the targets are printed beside the measurements, with a status
that never says "ok" for a figure the run cannot vouch for (:func:`status`). The sections' modules (torch, diffusers) are imported when a
section runs, so that ``offload-core bench --help`` answers at once."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable


def _section(module: str, function: str, **arguments: Callable[[bool], Any]) -> Callable[..., dict[str, Any]]:
    """A section that imports ``module`` when it runs and calls ``function`` with ``arguments``,
    each computed from ``quick``, and the section's own command-line options."""

    def run(quick: bool, **options: Any) -> dict[str, Any]:
        call = getattr(importlib.import_module(module, __name__), function)
        return call(**{name: value(quick) for name, value in arguments.items()}, **options)

    return run


@dataclasses.dataclass(frozen=True)
class Headline:
    """One row of the summary table: where the figure comes from and the target it is held to."""

    label: str
    section: str
    key: str
    target: float | None  # the figure must be <= target (>= with at_least); None: reported only
    floor: float | None = None  # a physical lower limit: below it beyond the spread, the baseline is broken
    at_least: bool = False  # a figure that must reach its target (a throughput share)
    ceiling: float | None = None  # a physical upper limit (a share of what the hardware can do)


UNRELIABLE = "unreliable (machine busy)"
#: a figure beyond its physical limit by more than its spread: what it was divided by measured too
#: little (a baseline that is not the limit it stands for), so the figure says nothing
BASELINE = "unreliable (baseline too weak)"


def status(value: float, spread: float, target: float | None, floor: float | None, at_least: bool = False,
           ceiling: float | None = None) -> str:
    """"ok", "MISSED", :data:`UNRELIABLE`, :data:`BASELINE`, or "" (reported only, and plausible).

    :data:`BASELINE`: a figure beyond a physical limit by more than its spread (a negative
    overhead, an offloaded run faster than the resident one, a tier faster than the drive it reads
    from). :data:`UNRELIABLE`: a figure that cannot be computed, or whose spread is larger than its
    distance to the target (it cannot say which side of the target it is on)."""
    if value != value:  # NaN: a denominator that vanished
        return UNRELIABLE
    if (floor is not None and value + spread < floor) or (ceiling is not None and value - spread > ceiling):
        return BASELINE
    if target is None:
        return ""
    if spread > abs(value - target):
        return UNRELIABLE
    return "ok" if (value >= target if at_least else value <= target) else "MISSED"


def _pick(quick: Any, full: Any) -> Callable[[bool], Any]:
    return lambda quick_run: quick if quick_run else full


SECTIONS: dict[str, Callable[..., dict[str, Any]]] = {
    "layerwise_overhead": _section(".layerwise", "overhead_per_block", layers=_pick(32, 32), repeats=_pick(20, 200)),
    "layerwise_compute": _section(".layerwise", "step_ratio", d=_pick(256, 1024), repeats=_pick(3, 8)),
    "layerwise_bandwidth": _section(".layerwise", "step_ratio", d=_pick(256, 1024), copy_to_compute=_pick(0.8, 0.8),
                                    repeats=_pick(3, 8)),
    "copies_per_block": _section(".layerwise", "copies_per_block"),
    "training": _section(".training", "training_step_ratio", d=_pick(256, 1024), repeats=_pick(3, 8)),
    "budget": _section(".budget", "budget_curve", d=_pick(256, 512), repeats=_pick(3, 6)),
    "strategies": _section(".pipeline", "strategies_side_by_side", repeats=_pick(2, 5)),
    "sanitizer": _section(".sanitizer", "sanitizer_cost", repeats=_pick(2, 5)),
    "host_memory": _section(".hostmem", "host_memory", quick=_pick(True, False)),
    "disk": _section(".disk", "disk_tier", quick=_pick(True, False), repeats=_pick(2, 5)),
    "realscale": _section(".realscale", "realscale"),
}
#: sections that run only when named (``--only``): realscale writes 40 GB of checkpoints
ON_REQUEST = ("realscale",)

HEADLINES = [
    # each block's tensors switch between slot and host views around its forward (two assignments
    # per tensor; see docs/benchmarks.md): guarded at DESIGN's 0.25 of diffusers' hooks, not pushed
    # below it (the offload contract's per-tensor checks stay)
    Headline("layerwise overhead per block, ours / diffusers group offloading", "layerwise_overhead",
             "ratio_ours_to_diffusers", 0.25, floor=0.0),
    Headline("layerwise step time / resident, compute-heavy stack", "layerwise_compute", "ratio", 1.15, floor=1.0),
    Headline("same, copy = 0.8 x compute (bandwidth model)", "layerwise_bandwidth", "ratio", 1.10, floor=1.0),
    Headline("copies per block per forward (fp32 blocks: 1 dtype)", "copies_per_block", "fp32_copies_per_block", 1.0),
    Headline("copies per block per forward (fp32+bf16: 1.5 dtypes)", "copies_per_block",
             "fp32+bf16_copies_per_block", 1.5),
    Headline("training step (forward + backward) / resident, copy = 0.8 x forward compute", "training", "ratio",
             1.15, floor=1.0),
    Headline("copies per block per training step (1 dtype; the last blocks stay for backward)", "training",
             "copies_per_block_per_step", 2.0),
    Headline("partial residency, copy = 2 x compute: step / resident over its ideal max(1, 2(1 - f)), worst of "
             "f = 0, 0.25, 0.5, 0.75", "budget", "worst_over_ideal", 1.10, floor=1.0),
    *(Headline(f"  {f}% of the blocks kept: step / resident over ideal", "budget", f"curve.{f}.over_ideal", 1.10,
               floor=1.0) for f in ("0", "25", "50", "75")),
    Headline("model-level swap cost per call, overlapped / synchronous", "strategies",
             "overlapped_to_sync_swap_cost", 1.0, floor=0.0),
    Headline("layerwise pipeline call / resident (bandwidth model)", "strategies", "ratio_to_resident.layerwise", None,
             floor=1.0),
    Headline("fake backend: layerwise pipeline call, race sanitizer on / off", "sanitizer", "sanitized_to_unsanitized",
             None, floor=1.0),
    Headline("host peak / model: load with from_pretrained", "host_memory", "load", None),
    Headline("  same / its bound, 1.15 x model + 1 GB", "host_memory", "load_over_bound", 1.0),
    Headline("host peak / model: enable on a built model", "host_memory", "enable_built", None),
    Headline("host peak / model: disable", "host_memory", "disable", 1.1),
    Headline("host RSS after a second enable/disable cycle / after the first", "host_memory",
             "second_cycle_over_first", 1.05),
    Headline("host peak / model: load with pinned_memory = model / 2", "host_memory", "pinned_half_load", None),
    Headline("host peak / model: disk tier, host_memory = model / 4 (load, forward)", "host_memory",
             "disk_quarter_forward", None),
    Headline("  same / its bound, budget + one block + 1 GB", "host_memory", "disk_over_bound", 1.0),
    Headline("enable time / plain copy of the same bytes", "host_memory", "enable_over_memcpy", 1.3, floor=0.0),
    Headline("from_pretrained load, seconds per GB", "host_memory", "load_s_per_gb", None),
    Headline("disk tier alone (block compute skipped): bytes read per second / the faster of the drive's reads "
             "just before and after (O_DIRECT, 8 or 16 reads in flight), cold cache (at least)", "disk", "tier_over_raw", 0.8, at_least=True, ceiling=1.0),
    Headline("disk-bound forward / max(in-RAM forward, bytes read / the drive's speed)", "disk",
             "forward_over_ideal", 1.10, floor=1.0),
    Headline("  disk tier's CPU time per GB read (the process's, above the in-RAM forward's), s", "disk",
             "tier_cpu_s_per_gb", None),
    *(row for model, name in (("wan", "Wan2.2-A14B transformer"), ("umt5", "UMT5-XXL encoder")) for row in (
        Headline(f"real scale, {name}: host peak RSS (the fake device's memory taken out) / (host_memory + "
                 "2.5 GiB)", "realscale", f"{model}.host_peak_rss_over_bound", 1.0),
        Headline("  same, the fake device's memory included", "realscale", f"{model}.peak_rss_over_bound", None),
        Headline("  output elements differing from the streaming reference (0: torch.equal)", "realscale",
                 f"{model}.differing_elements", 0),
        Headline("  from_pretrained load, s", "realscale", f"{model}.load_s", None),
        Headline("  one forward (tiny input), s", "realscale", f"{model}.forward_s", None),
        Headline("  disk read during the forward, MB/s", "realscale", f"{model}.disk_read_mb_per_s", None),
        Headline("  streaming reference: peak RSS / the same bound", "realscale",
                 f"{model}.reference_peak_rss_over_bound", None),
    )),
]


def run(sections: list[str] | None = None, quick: bool = False,
        options: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run the named sections (default: all but :data:`ON_REQUEST`) and return their raw results;
    ``options``: keyword arguments of a section, by its name."""
    names = sections or [name for name in SECTIONS if name not in ON_REQUEST]
    return {name: SECTIONS[name](quick, **(options or {}).get(name, {})) for name in names}


def headline_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per headline of the sections that ran: value, spread (None for a figure measured
    once: memory, counts), target (a bound from above, or from below with at_least) and status."""
    rows = []
    for h in HEADLINES:
        if h.section not in results:
            continue
        value: Any = results[h.section]
        for part in h.key.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        if value is None:
            continue  # a part of the section that did not run (realscale with one model)
        spread = results[h.section].get("spread", {}).get(h.key)
        rows.append({
            "figure": h.label,
            "value": value,
            "spread": spread,
            "target": h.target,
            "at_least": h.at_least,
            "status": status(value, spread or 0.0, h.target, h.floor, h.at_least, h.ceiling),
        })
    return rows


def failed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows ``bench --check`` fails on: a missed target, or a figure it cannot vouch for."""
    return [r for r in rows if r["status"] in ("MISSED", UNRELIABLE, BASELINE)]


__all__ = ["BASELINE", "HEADLINES", "ON_REQUEST", "SECTIONS", "UNRELIABLE", "failed", "headline_rows", "run",
           "status"]
