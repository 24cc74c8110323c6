"""Layerwise benchmarks (docs/benchmarks.md): framework overhead per block against diffusers' group
offloading, step-time ratios on a compute-heavy stack with and without a bandwidth model, and
copies per block per forward."""

from __future__ import annotations

import copy
import functools
import logging
import statistics
import time
from typing import Any

import torch
from torch import nn

from ..api import enable_offload
from ..device.plugins import get_backend
from .timing import bandwidth_calibration, interleaved, ratio

logger = logging.getLogger(__name__)


class MLPBlock(nn.Module):
    def __init__(self, d: int, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d, dtype=dtype)
        self.down = nn.Linear(4 * d, d, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x).to(self.up.weight.dtype))
        return x + self.down(torch.nn.functional.gelu(h)).to(x.dtype)


class MLPStack(nn.Module):
    """A compute-heavy stack: the blocks dominate, as in a video DiT."""

    def __init__(self, blocks: int, d: int, dtypes: tuple[torch.dtype, ...] = (torch.float32,)) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(d, dtypes[i % len(dtypes)]) for i in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def tiny_wan(layers: int) -> tuple[nn.Module, dict[str, Any]]:
    """A WanTransformer3DModel with tiny blocks, so per-block framework cost dominates."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(0)
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=16, ffn_dim=32, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32,
    ).eval()
    g = torch.Generator().manual_seed(1)
    inputs = {
        "hidden_states": torch.randn(1, 4, 2, 4, 4, generator=g),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": torch.randn(1, 8, 16, generator=g),
        "return_dict": False,
    }
    return model, inputs


class BlockClock:
    """The calling thread's CPU time spent inside the blocks' own forwards: each block's
    ``forward`` wrapped (before any offloading is applied, so that an offloading library's work
    around the forward stays outside)."""

    def __init__(self, blocks: list[nn.Module]) -> None:
        self.inside_ns = 0
        for block in blocks:
            block.forward = functools.partial(self._timed, block.forward)

    def _timed(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.thread_time_ns()
        try:
            return forward(*args, **kwargs)
        finally:
            self.inside_ns += time.thread_time_ns() - start

    def outside_ns(self, call: Any) -> int:
        """Thread CPU time of ``call()`` outside the block forwards."""
        self.inside_ns = 0
        start = time.thread_time_ns()
        call()
        return time.thread_time_ns() - start - self.inside_ns


def overhead_per_block(layers: int = 32, repeats: int = 200) -> dict[str, Any]:
    """(a) Framework overhead per block, ours (real copies on the fake device) and diffusers'
    ``apply_group_offloading`` (block level, onload and offload on the CPU): the calling thread's
    CPU time outside the blocks' own forwards, offloaded minus resident, per block.

    Thread CPU time, not wall time: the figure is tens of microseconds per block, which wall
    clocks on a shared machine cannot resolve (another process's time slice is thousands of
    them), while a thread's CPU time does not advance while it is descheduled or waiting. The
    three variants are interleaved call by call over ``repeats`` passes; the ratio is the median
    of the per-pass ratios, with its spread. The steadier figure beside it is the ratio of the
    per-block overheads computed from each variant's fastest pass: a busy machine only adds CPU
    time to a pass (cache misses, interrupts), so the minimum moves least with load."""
    from diffusers.hooks import apply_group_offloading

    resident, inputs = tiny_wan(layers)
    ours, theirs = copy.deepcopy(resident), copy.deepcopy(resident)
    clocks = {name: BlockClock(list(model.blocks)) for name, model in
              (("resident", resident), ("ours", ours), ("diffusers", theirs))}
    handle = enable_offload(ours, enable_layerwise_offload=True, backend=get_backend("fake", chaos=False))
    cpu = torch.device("cpu")
    apply_group_offloading(theirs, onload_device=cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1)
    models = {"resident": resident, "ours": ours, "diffusers": theirs}
    outside: dict[str, list[int]] = {name: [] for name in models}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: intra-op threads add only noise to a per-block figure
    try:
        with torch.no_grad():
            for name, model in models.items():  # warm-up
                model(**inputs)
            for _ in range(repeats):
                for name, model in models.items():
                    outside[name].append(clocks[name].outside_ns(lambda m=model: m(**inputs)))
    finally:
        torch.set_num_threads(threads)
        handle.disable()
    ours_block = [(o - r) / layers / 1e9 for o, r in zip(outside["ours"], outside["resident"])]
    theirs_block = [(d - r) / layers / 1e9 for d, r in zip(outside["diffusers"], outside["resident"])]
    value, spread = ratio(ours_block, theirs_block)
    fastest = {name: min(times) for name, times in outside.items()}
    ours_min = (fastest["ours"] - fastest["resident"]) / layers / 1e9
    theirs_min = (fastest["diffusers"] - fastest["resident"]) / layers / 1e9
    return {
        "blocks": layers,
        "passes": repeats,
        "resident_outside_blocks_s": statistics.median(outside["resident"]) / 1e9,
        "ours_overhead_per_block_s": statistics.median(ours_block),
        "diffusers_overhead_per_block_s": statistics.median(theirs_block),
        "ratio_ours_to_diffusers": value,
        "fastest_pass": {
            "ours_overhead_per_block_s": ours_min,
            "diffusers_overhead_per_block_s": theirs_min,
            "ratio_ours_to_diffusers": ours_min / theirs_min if theirs_min > 0 else float("nan"),
        },
        "spread": {"ratio_ours_to_diffusers": spread},
    }


def step_ratio(blocks: int = 8, d: int = 1024, tokens: int = 128, copy_to_compute: float | None = None,
               repeats: int = 8) -> dict[str, Any]:
    """(b)/(c) Offloaded / resident step time on a compute-heavy stack with one torch thread.

    ``copy_to_compute``: when set, the fake device's bandwidth is chosen so that one block's copy
    takes that fraction of one block's compute time, recalibrated after every resident call from
    that call's time (so that load during the run changes the copy time with the compute time).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        resident = MLPStack(blocks, d).eval()
        offloaded = copy.deepcopy(resident)
        x = torch.randn(tokens, d)
        block_bytes = sum(p.numel() * p.element_size() for p in resident.blocks[0].parameters())
        backend = get_backend("fake", chaos=False)
        calibrate = None
        if copy_to_compute is not None:
            calibrate = bandwidth_calibration(backend, block_bytes, blocks, copy_to_compute, "resident")
            with torch.no_grad():
                start = time.perf_counter()
                resident(x)
                calibrate("resident", time.perf_counter() - start)
        handle = enable_offload(offloaded, enable_layerwise_offload=True, backend=backend)
        with handle.frozen():  # successive steps, as a pipeline call runs them
            times = interleaved({"resident": lambda: resident(x), "offloaded": lambda: offloaded(x)}, repeats,
                                after=calibrate)
        misses = handle.stats()["prefetch_misses"]
        handle.disable()
    finally:
        torch.set_num_threads(threads)
    value, spread = ratio(times["offloaded"], times["resident"])
    result: dict[str, Any] = {
        "blocks": blocks, "d": d, "tokens": tokens, "block_bytes": block_bytes,
        "resident_s": statistics.median(times["resident"]), "offloaded_s": statistics.median(times["offloaded"]),
        "ratio": value, "prefetch_misses": misses, "spread": {"ratio": spread},
    }
    if copy_to_compute is not None:
        result["copy_to_compute"] = copy_to_compute
        result["h2d_bandwidth_bytes_per_s"] = backend.h2d_bandwidth
    return result


def copies_per_block(blocks: int = 8, d: int = 64) -> dict[str, float]:
    """(d) Host-to-device copies per block per forward, on stacks of one and of two dtypes."""
    out: dict[str, float] = {}
    for label, dtypes in (("fp32", (torch.float32,)), ("fp32+bf16", (torch.float32, torch.bfloat16))):
        model = MLPStack(blocks, d, dtypes).eval()
        handle = enable_offload(model, enable_layerwise_offload=True, backend=get_backend("fake", chaos=False))
        x = torch.randn(4, d)
        with torch.no_grad():
            model(x)
            before = handle.stats()["h2d_copies"]
            model(x)
            after = handle.stats()["h2d_copies"]
        dtypes_per_block = sum(len(u.numel) for u in handle.parts[0].units) / blocks
        handle.disable()
        out[f"{label}_copies_per_block"] = (after - before) / blocks
        out[f"{label}_dtypes_per_block"] = dtypes_per_block
    return out
