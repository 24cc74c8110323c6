"""Benchmarks behind ``offload-core bench``: every figure is a ratio measured in one run, the
variants interleaved (docs/benchmarks.md). Timed tests would be flaky; these report, and the targets are
printed beside the measurements."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from .layerwise import copies_per_block, overhead_per_block, step_ratio
from .pipeline import strategies_side_by_side
from .sanitizer import sanitizer_cost


@dataclasses.dataclass(frozen=True)
class Headline:
    """One row of the summary table: where the figure comes from and the target it is held to."""

    label: str
    section: str
    key: str
    target: float | None  # the figure must be <= target; None: reported only


SECTIONS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "layerwise_overhead": lambda quick: overhead_per_block(layers=32, repeats=5 if quick else 30),
    "layerwise_compute": lambda quick: step_ratio(d=256 if quick else 1024, repeats=3 if quick else 8),
    "layerwise_bandwidth": lambda quick: step_ratio(d=256 if quick else 1024, copy_to_compute=0.8,
                                                    repeats=3 if quick else 8),
    "copies_per_block": lambda quick: copies_per_block(),
    "strategies": lambda quick: strategies_side_by_side(repeats=2 if quick else 5),
    "sanitizer": lambda quick: sanitizer_cost(repeats=2 if quick else 5),
}

HEADLINES = [
    Headline("layerwise overhead per block, ours / diffusers group offloading", "layerwise_overhead",
             "ratio_ours_to_diffusers", 0.10),
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
