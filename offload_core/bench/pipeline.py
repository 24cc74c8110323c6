"""Strategies side by side on one tiny pipeline: no offload, model-level with a synchronous swap,
model-level with the overlapped (prefetched) swap, and layerwise, all interleaved in one run.

The fake device gets a bandwidth model sized so that copying every weight once takes about as
long as one resident pipeline call: on a CPU, copies would otherwise be too cheap to show what
the overlap buys on a PCIe link.
"""

from __future__ import annotations

from typing import Any

from ..api import enable_offload
from ..plugins import get_backend
from ..tiny import build_pipeline
from .timing import interleaved


def strategies_side_by_side(pipeline: str = "flux2", repeats: int = 5, copy_to_compute: float = 1.0) -> dict[str, Any]:
    """Per-call seconds and swap cost (offloaded - resident) per strategy, and their ratios."""
    variants = {name: build_pipeline(pipeline) for name in ("none", "model_sync", "model_overlapped", "layerwise")}
    resident_s = interleaved({"none": lambda: variants["none"].run(seed=0)}, 3)["none"]
    probe = enable_offload(variants["model_sync"].pipe, enable_cpu_offload=True, backend=get_backend("fake", chaos=False))
    weight_bytes = probe.stats()["host_bytes"]
    probe.disable()
    bandwidth = weight_bytes / (copy_to_compute * resident_s)
    handles = {
        "model_sync": enable_offload(variants["model_sync"].pipe, enable_cpu_offload=True,
                                     backend=get_backend("fake", h2d_bandwidth=bandwidth)),
        "model_overlapped": enable_offload(variants["model_overlapped"].pipe, enable_cpu_offload=True,
                                           backend=get_backend("fake", h2d_bandwidth=bandwidth)),
        "layerwise": enable_offload(variants["layerwise"].pipe, enable_layerwise_offload=True,
                                    backend=get_backend("fake", h2d_bandwidth=bandwidth)),
    }
    handles["model_sync"].parts[0].prefetch = False  # the anchors' synchronous swap, for comparison
    times = interleaved({name: (lambda t=tiny: t.run(seed=0)) for name, tiny in variants.items()}, repeats)
    stats = {name: h.stats() for name, h in handles.items()}
    for handle in handles.values():
        handle.disable()
    swap = {name: times[name] - times["none"] for name in handles}
    return {
        "pipeline": pipeline,
        "weight_bytes": weight_bytes,
        "h2d_bandwidth_bytes_per_s": bandwidth,
        "seconds_per_call": times,
        "swap_cost_per_call_s": swap,
        "ratio_to_resident": {name: times[name] / times["none"] for name in handles},
        "overlapped_to_sync_swap_cost": swap["model_overlapped"] / swap["model_sync"] if swap["model_sync"] > 0 else float("nan"),
        "device_peak_bytes": {name: s["device_peak_bytes"] for name, s in stats.items()},
    }
