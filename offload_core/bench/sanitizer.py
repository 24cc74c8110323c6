"""What the fake backend's race sanitizer costs: one tiny pipeline streamed layer by layer on two
fake backends, one sanitizing, one not, their calls interleaved in one run.

The sanitizer's dispatch mode sees every torch operation of the thread once installed, so the
unsanitized calls run with it taken off the thread (``paused``), as in a process that never
sanitizes.
"""

from __future__ import annotations

import statistics
from typing import Any

from ..api import enable_offload
from ..device.plugins import get_backend
from ..tiny import build_pipeline
from .timing import interleaved, ratio


def sanitizer_cost(pipeline: str = "flux2", repeats: int = 5) -> dict[str, Any]:
    """Seconds per layerwise-offloaded call with and without the sanitizer, and their ratio."""
    from offload_core_fake.sanitizer import paused

    plain, checked = build_pipeline(pipeline), build_pipeline(pipeline)
    handles = [
        enable_offload(plain.pipe, enable_layerwise_offload=True, backend=get_backend("fake", sanitize=False)),
        enable_offload(checked.pipe, enable_layerwise_offload=True, backend=get_backend("fake", sanitize=True)),
    ]

    def unsanitized() -> None:
        with paused():
            plain.run(seed=0)

    try:
        times = interleaved({"unsanitized": unsanitized, "sanitized": lambda: checked.run(seed=0)}, repeats)
    finally:
        for handle in handles:
            handle.disable()
    value, spread = ratio(times["sanitized"], times["unsanitized"])
    return {
        "pipeline": pipeline,
        "seconds_per_call": {name: statistics.median(t) for name, t in times.items()},
        "sanitized_to_unsanitized": value,
        "spread": {"sanitized_to_unsanitized": spread},
    }
