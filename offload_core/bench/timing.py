"""Interleaved timing: every ratio the benchmarks report comes from one run, with the variants'
repetitions alternating (A, B, C, A, B, C, ...) so that drift (thermal, other load) hits all of
them alike, and is reported with its spread over the repetitions.

A ratio is taken per repetition (A's i-th sample over B's i-th, which ran next to each other) and
summarised by the median of those ratios; its spread is half their interquartile range. On a busy
machine the spread grows: a figure whose spread is larger than its distance to the target
cannot say which side of the target it is on (see :func:`offload_core.bench.status`).
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Mapping

import torch


def interleaved(
    variants: Mapping[str, Callable[[], object]],
    repeats: int,
    warmup: int = 1,
    clock: Callable[[], float] = time.perf_counter,
    after: Callable[[str, float], None] | None = None,
) -> dict[str, list[float]]:
    """The samples of each variant (seconds per call by ``clock``), the calls alternating variant
    by variant. ``after(name, sample)`` runs after each timed call, outside the timing: a
    calibration that must follow the figure it calibrates (a bandwidth derived from the
    resident time just measured) goes there."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    with torch.no_grad():
        for _ in range(warmup):
            for fn in variants.values():
                fn()
        for _ in range(repeats):
            for name, fn in variants.items():
                start = clock()
                fn()
                samples[name].append(clock() - start)
                if after is not None:
                    after(name, samples[name][-1])
    return samples


def spread(values: list[float]) -> float:
    """Half the interquartile range (0 for fewer than two values)."""
    if len(values) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return (q3 - q1) / 2


def ratio(numerators: list[float], denominators: list[float]) -> tuple[float, float]:
    """(median, spread) of the per-repetition ratios."""
    ratios = [a / b for a, b in zip(numerators, denominators) if b != 0]
    if not ratios:
        return float("nan"), float("nan")
    return statistics.median(ratios), spread(ratios)


def bandwidth_calibration(backend, block_bytes: int, blocks: int, copy_to_compute: float,
                          name: str) -> Callable[[str, float], None]:
    """An ``after`` for :func:`interleaved`: each call of variant ``name`` (a resident forward)
    sets the fake backend's bandwidth so that one block's copy takes ``copy_to_compute`` of one
    block's share of that call, so that load during the run changes copy and compute time alike."""

    def calibrate(variant: str, seconds: float) -> None:
        if variant == name:
            backend.h2d_bandwidth = block_bytes / (copy_to_compute * seconds / blocks)

    return calibrate
