"""Strategies side by side on one tiny pipeline: no offload, model-level with a synchronous swap,
model-level with the overlapped (prefetched) swap, and layerwise, all interleaved in one run.

The fake devices get a bandwidth model sized so that copying every weight once takes about as
long as one resident pipeline call: on a CPU, copies would otherwise be too cheap to show what
the overlap buys on a PCIe link. The bandwidth is recalibrated after every resident call from
that call's time, so that load during the run slows the copies with the compute.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..api import enable_offload
from ..device.plugins import get_backend
from ..tiny import build_pipeline
from .timing import interleaved, ratio


def strategies_side_by_side(pipeline: str = "flux2", repeats: int = 5, copy_to_compute: float = 1.0) -> dict[str, Any]:
    """Per-call seconds and swap cost (offloaded - resident) per strategy, and their ratios with
    their spreads (per repetition, the calls of one repetition ran next to each other)."""
    variants = {name: build_pipeline(pipeline) for name in ("none", "model_sync", "model_overlapped", "layerwise")}
    probe = enable_offload(variants["model_sync"].pipe, enable_cpu_offload=True, backend=get_backend("fake", chaos=False))
    weight_bytes = probe.stats()["host_bytes"]
    probe.disable()
    backends = {name: get_backend("fake", chaos=False) for name in ("model_sync", "model_overlapped", "layerwise")}

    def calibrate(name: str, seconds: float) -> None:
        if name == "none":
            for backend in backends.values():
                backend.h2d_bandwidth = weight_bytes / (copy_to_compute * seconds)

    calibrate("none", statistics.median(interleaved({"none": lambda: variants["none"].run(seed=0)}, 3)["none"]))
    handles = {
        "model_sync": enable_offload(variants["model_sync"].pipe, enable_cpu_offload=True, backend=backends["model_sync"]),
        "model_overlapped": enable_offload(variants["model_overlapped"].pipe, enable_cpu_offload=True,
                                           backend=backends["model_overlapped"]),
        "layerwise": enable_offload(variants["layerwise"].pipe, enable_layerwise_offload=True,
                                    backend=backends["layerwise"]),
    }
    handles["model_sync"].parts[0].prefetch = False  # the anchors' synchronous swap, for comparison
    times = interleaved({name: (lambda t=tiny: t.run(seed=0)) for name, tiny in variants.items()}, repeats,
                        after=calibrate)
    stats = {name: h.stats() for name, h in handles.items()}
    for handle in handles.values():
        handle.disable()
    swap = {name: [t - n for t, n in zip(times[name], times["none"])] for name in handles}
    overlapped, overlapped_spread = ratio(swap["model_overlapped"], swap["model_sync"])
    to_resident = {name: ratio(times[name], times["none"]) for name in handles}
    return {
        "pipeline": pipeline,
        "weight_bytes": weight_bytes,
        "seconds_per_call": {name: statistics.median(t) for name, t in times.items()},
        "swap_cost_per_call_s": {name: statistics.median(t) for name, t in swap.items()},
        "ratio_to_resident": {name: r[0] for name, r in to_resident.items()},
        "overlapped_to_sync_swap_cost": overlapped,
        "device_peak_bytes": {name: s["device_peak_bytes"] for name, s in stats.items()},
        "spread": {"overlapped_to_sync_swap_cost": overlapped_spread,
                   **{f"ratio_to_resident.{name}": r[1] for name, r in to_resident.items()}},
    }
