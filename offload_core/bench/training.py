"""Training benchmark (docs/benchmarks.md): a forward and backward through a layerwise-offloaded
compute-heavy stack against the same resident stack, with the fake's bandwidth set so that one
block's copy takes 0.8 of one block's forward compute; and the copies per block per training step
(one in forward and one in backward, per dtype, less the blocks still in their slots)."""

from __future__ import annotations

import copy
import statistics
from typing import Any

import torch

from ..api import enable_offload
from .calibrated import calibrated_stack
from .timing import interleaved, ratio


def _step(model: torch.nn.Module, x: torch.Tensor) -> None:
    """One training step's forward and backward (full fine-tuning: every weight gets a gradient)."""
    with torch.enable_grad():
        model.zero_grad(set_to_none=True)
        model(x).square().mean().backward()


def training_step_ratio(blocks: int = 8, d: int = 1024, tokens: int = 128, copy_to_compute: float = 0.8,
                        repeats: int = 8) -> dict[str, Any]:
    """The bandwidth is recalibrated after every resident forward (timed in the same interleaving),
    so that load during the run changes copy and compute times alike."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        resident, x, backend, calibrate, block_bytes = calibrated_stack(blocks, d, tokens, copy_to_compute, "forward")
        offloaded = copy.deepcopy(resident)
        handle = enable_offload(offloaded, enable_layerwise_offload=True, backend=backend)
        _step(offloaded, x)  # the first step allocates the gradients
        before = handle.stats()
        times = interleaved(
            {"forward": lambda: resident(x), "resident": lambda: _step(resident, x),
             "offloaded": lambda: _step(offloaded, x)},
            repeats, after=calibrate,
        )
        after = handle.stats()
        steps = repeats + 1  # the warm-up round included
        dtypes = sum(len(u.numel) for u in handle.parts[0].units) / blocks
        handle.disable()
    finally:
        torch.set_num_threads(threads)
    value, spread = ratio(times["offloaded"], times["resident"])
    return {
        "blocks": blocks, "d": d, "tokens": tokens, "block_bytes": block_bytes, "copy_to_compute": copy_to_compute,
        "h2d_bandwidth_bytes_per_s": backend.h2d_bandwidth,
        "resident_s": statistics.median(times["resident"]), "offloaded_s": statistics.median(times["offloaded"]),
        "ratio": value, "spread": {"ratio": spread},
        "copies_per_block_per_step": (after["h2d_copies"] - before["h2d_copies"]) / (steps * blocks),
        "dtypes_per_block": dtypes,
        "prefetch_misses": after["prefetch_misses"] - before["prefetch_misses"],
    }
