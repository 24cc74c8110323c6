"""The compute-heavy stack of the bandwidth-model benchmarks, with a fake backend whose bandwidth
follows the stack's measured compute (see :func:`offload_core.bench.timing.bandwidth_calibration`)."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ..device.plugins import get_backend
from .layerwise import MLPStack
from .timing import bandwidth_calibration


def calibrated_stack(blocks: int, d: int, tokens: int, copy_to_compute: float, variant: str
                     ) -> tuple[MLPStack, torch.Tensor, Any, Callable[[str, float], None], int]:
    """A seeded resident stack, its input, a fake backend (no chaos) with its bandwidth set from one
    timed resident forward, the calibration to run after each call of ``variant``, and one block's
    bytes."""
    torch.manual_seed(0)
    resident = MLPStack(blocks, d)
    x = torch.randn(tokens, d)
    block_bytes = sum(p.numel() * p.element_size() for p in resident.blocks[0].parameters())
    backend = get_backend("fake", chaos=False)
    calibrate = bandwidth_calibration(backend, block_bytes, blocks, copy_to_compute, variant)
    with torch.no_grad():
        start = time.perf_counter()
        resident(x)
        calibrate(variant, time.perf_counter() - start)
    return resident, x, backend, calibrate, block_bytes
