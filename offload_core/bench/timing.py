"""Interleaved timing: every ratio the benchmarks report comes from one run, with the variants'
repetitions alternating so that drift (thermal, other load) hits all of them alike."""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import torch


def interleaved(
    variants: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> dict[str, float]:
    """Seconds per call of each variant (``statistic`` of its samples: the median, or ``min`` for
    small costs where a noisy machine only ever adds time), the calls alternating variant by variant."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(warmup):
            for fn in variants.values():
                fn()
        for _ in range(repeats):
            for name, fn in variants.items():
                start = time.perf_counter()
                fn()
                samples[name].append(time.perf_counter() - start)
    return {name: statistic(values) for name, values in samples.items()}
