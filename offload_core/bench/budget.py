"""Budget benchmark (docs/benchmarks.md): layerwise step time over resident when a fraction of the
blocks stays on the device (partial residency), on a copy-bound stack: the fake's bandwidth is set
so that copying one block takes ``copy_to_compute`` (2) times its compute. The ideal, with perfect
spacing and no start-up cost, is max(1, copy_to_compute x (1 - f)) at fraction f; each figure is
reported over its ideal."""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

from ..api import enable_offload
from .calibrated import calibrated_stack
from .timing import interleaved, ratio

FRACTIONS = (0.0, 0.25, 0.5, 0.75)


def budget_curve(blocks: int = 16, d: int = 512, tokens: int = 512, copy_to_compute: float = 2.0,
                 repeats: int = 6) -> dict[str, Any]:
    """One offloaded copy of the stack per fraction, all interleaved with the resident stack in one
    run; the bandwidth is recalibrated after every resident forward. Each forward starts with empty
    slots (no ``frozen()``): its first streamed block's copy is exposed unless a kept block comes
    first, which the ideal leaves out (about 1/blocks of a step at f = 0).

    Many tokens per weight byte: the fake copies for real on a CPU core beside the compute (then
    sleeps out the modelled time), and with fewer tokens that memcpy's share of the machine's
    memory bandwidth slows the compute it should overlap (d = 1024, 128 tokens: 1.22 at f = 0.5)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    handles = []
    try:
        resident, x, backend, calibrate, block_bytes = calibrated_stack(blocks, d, tokens, copy_to_compute, "resident")
        variants: dict[str, Any] = {"resident": lambda: resident(x)}
        for fraction in FRACTIONS:
            model = copy.deepcopy(resident)
            handles.append(enable_offload(model, enable_layerwise_offload=True, backend=backend,
                                          resident_blocks=round(fraction * blocks)))
            variants[_key(fraction)] = model
        times = interleaved({name: (fn if name == "resident" else _call(fn, x)) for name, fn in variants.items()},
                            repeats, after=calibrate)
        kept = {_key(f): [i for i, name in enumerate(h.parts[0].all_names) if name in h.parts[0].kept_names]
                for f, h in zip(FRACTIONS, handles)}
    finally:
        for handle in handles:
            handle.disable()
        torch.set_num_threads(threads)
    curve, spread = {}, {}
    for fraction in FRACTIONS:
        name = _key(fraction)
        value, error = ratio(times[name], times["resident"])
        ideal = max(1.0, copy_to_compute * (1 - fraction))
        curve[name] = {"resident_blocks": len(kept[name]), "kept": kept[name], "ratio": value, "ideal": ideal,
                       "over_ideal": value / ideal}
        spread[f"curve.{name}.over_ideal"] = error / ideal
    worst = max(curve, key=lambda name: curve[name]["over_ideal"])
    spread["worst_over_ideal"] = spread[f"curve.{worst}.over_ideal"]
    return {
        "blocks": blocks, "d": d, "tokens": tokens, "block_bytes": block_bytes, "copy_to_compute": copy_to_compute,
        "h2d_bandwidth_bytes_per_s": backend.h2d_bandwidth, "resident_s": statistics.median(times["resident"]),
        "curve": curve, "worst_over_ideal": curve[worst]["over_ideal"], "worst_fraction": int(worst) / 100,
        "spread": spread,
    }


def _key(fraction: float) -> str:
    """A curve point's key: the percentage of blocks kept ("25")."""
    return f"{round(100 * fraction)}"


def _call(model: torch.nn.Module, x: torch.Tensor):
    return lambda: model(x)
