"""Benchmarks behind ``offload-core bench``: every figure is a ratio measured in one run, the
variants interleaved (docs/benchmarks.md). Timed tests would be flaky; these report, and the targets are
printed beside the measurements. The sections' modules (torch, diffusers) are imported when a
section runs, so that ``offload-core bench --help`` answers at once."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable


def _section(module: str, function: str, **arguments: Callable[[bool], Any]) -> Callable[[bool], dict[str, Any]]:
    """A section that imports ``module`` when it runs and calls ``function`` with ``arguments``,
    each computed from ``quick``."""

    def run(quick: bool) -> dict[str, Any]:
        call = getattr(importlib.import_module(module, __name__), function)
        return call(**{name: value(quick) for name, value in arguments.items()})

    return run


@dataclasses.dataclass(frozen=True)
class Headline:
    """One row of the summary table: where the figure comes from and the target it is held to."""

    label: str
    section: str
    key: str
    target: float | None  # the figure must be <= target; None: reported only


def _pick(quick: Any, full: Any) -> Callable[[bool], Any]:
    return lambda quick_run: quick if quick_run else full


SECTIONS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "layerwise_overhead": _section(".layerwise", "overhead_per_block", layers=_pick(32, 32), repeats=_pick(5, 30)),
    "layerwise_compute": _section(".layerwise", "step_ratio", d=_pick(256, 1024), repeats=_pick(3, 8)),
    "layerwise_bandwidth": _section(".layerwise", "step_ratio", d=_pick(256, 1024), copy_to_compute=_pick(0.8, 0.8),
                                    repeats=_pick(3, 8)),
    "copies_per_block": _section(".layerwise", "copies_per_block"),
    "strategies": _section(".pipeline", "strategies_side_by_side", repeats=_pick(2, 5)),
    "sanitizer": _section(".sanitizer", "sanitizer_cost", repeats=_pick(2, 5)),
    "host_memory": _section(".hostmem", "host_memory", quick=_pick(True, False)),
}

HEADLINES = [
    # each block's tensors switch between slot and host views around its forward (two assignments
    # per tensor; see docs/benchmarks.md): well under diffusers' hooks, above the 0.10 of before
    Headline("layerwise overhead per block, ours / diffusers group offloading", "layerwise_overhead",
             "ratio_ours_to_diffusers", 0.35),
    Headline("layerwise step time / resident, compute-heavy stack", "layerwise_compute", "ratio", 1.15),
    Headline("same, copy = 0.8 x compute (bandwidth model)", "layerwise_bandwidth", "ratio", 1.10),
    Headline("copies per block per forward (fp32 blocks: 1 dtype)", "copies_per_block", "fp32_copies_per_block", 1.0),
    Headline("copies per block per forward (fp32+bf16: 1.5 dtypes)", "copies_per_block",
             "fp32+bf16_copies_per_block", 1.5),
    Headline("model-level swap cost per call, overlapped / synchronous", "strategies",
             "overlapped_to_sync_swap_cost", 1.0),
    Headline("layerwise pipeline call / resident (bandwidth model)", "strategies", "ratio_to_resident.layerwise", None),
    Headline("fake backend: layerwise pipeline call, race sanitizer on / off", "sanitizer", "sanitized_to_unsanitized",
             None),
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
    Headline("enable time / plain copy of the same bytes", "host_memory", "enable_over_memcpy", 1.3),
    Headline("from_pretrained load, seconds per GB", "host_memory", "load_s_per_gb", None),
]


def run(sections: list[str] | None = None, quick: bool = False) -> dict[str, Any]:
    """Run the named sections (default: all) and return their raw results."""
    return {name: SECTIONS[name](quick) for name in sections or list(SECTIONS)}


def headline_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for h in HEADLINES:
        if h.section not in results:
            continue
        value: Any = results[h.section]
        for part in h.key.split("."):
            value = value[part]
        rows.append({
            "figure": h.label,
            "value": value,
            "target": h.target,
            "meets_target": None if h.target is None else bool(value <= h.target),
        })
    return rows


__all__ = ["HEADLINES", "SECTIONS", "headline_rows", "run"]
