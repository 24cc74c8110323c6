"""Layerwise benchmarks (docs/benchmarks.md): framework overhead per block against diffusers' group
offloading, step-time ratios on a compute-heavy stack with and without a bandwidth model, and
copies per block per forward."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch
from torch import nn

from ..api import enable_offload
from ..plugins import get_backend
from .timing import interleaved

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


def overhead_per_block(layers: int = 32, repeats: int = 30) -> dict[str, float]:
    """(a) Seconds of framework overhead per block: ours (real copies on the fake device) and
    diffusers' ``apply_group_offloading`` (block level, onload and offload on the CPU)."""
    from diffusers.hooks import apply_group_offloading

    resident, inputs = tiny_wan(layers)
    ours, theirs = copy.deepcopy(resident), copy.deepcopy(resident)
    handle = enable_offload(ours, enable_layerwise_offload=True, backend=get_backend("fake", chaos=False))
    cpu = torch.device("cpu")
    apply_group_offloading(theirs, onload_device=cpu, offload_device=cpu, offload_type="block_level", num_blocks_per_group=1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: intra-op threads add only noise to a per-block figure
    try:
        times = interleaved(
            {"resident": lambda: resident(**inputs), "ours": lambda: ours(**inputs), "diffusers": lambda: theirs(**inputs)},
            repeats,
            statistic=min,  # per-block costs of tens of microseconds: noise only ever adds
        )
    finally:
        torch.set_num_threads(threads)
        handle.disable()
    ours_block = (times["ours"] - times["resident"]) / layers
    theirs_block = (times["diffusers"] - times["resident"]) / layers
    return {
        "blocks": layers,
        "resident_s": times["resident"],
        "ours_overhead_per_block_s": ours_block,
        "diffusers_overhead_per_block_s": theirs_block,
        "ratio_ours_to_diffusers": ours_block / theirs_block if theirs_block > 0 else float("nan"),
    }


def step_ratio(blocks: int = 8, d: int = 1024, tokens: int = 128, copy_to_compute: float | None = None,
               repeats: int = 8) -> dict[str, float]:
    """(b)/(c) Offloaded / resident step time on a compute-heavy stack with one torch thread.

    ``copy_to_compute``: when set, the fake device's bandwidth is chosen so that one block's copy
    takes that fraction of one block's compute time (measured first in this run).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        resident = MLPStack(blocks, d).eval()
        offloaded = copy.deepcopy(resident)
        x = torch.randn(tokens, d)
        options: dict[str, Any] = {"chaos": False}
        block_bytes = sum(p.numel() * p.element_size() for p in resident.blocks[0].parameters())
        if copy_to_compute is not None:
            per_block = interleaved({"resident": lambda: resident(x)}, 3)["resident"] / blocks
            options["h2d_bandwidth"] = block_bytes / (copy_to_compute * per_block)
        handle = enable_offload(offloaded, enable_layerwise_offload=True, backend=get_backend("fake", **options))
        times = interleaved({"resident": lambda: resident(x), "offloaded": lambda: offloaded(x)}, repeats)
        misses = handle.stats()["prefetch_misses"]
        handle.disable()
    finally:
        torch.set_num_threads(threads)
    result = {
        "blocks": blocks, "d": d, "tokens": tokens, "block_bytes": block_bytes,
        "resident_s": times["resident"], "offloaded_s": times["offloaded"],
        "ratio": times["offloaded"] / times["resident"], "prefetch_misses": misses,
    }
    if copy_to_compute is not None:
        result["copy_to_compute"] = copy_to_compute
        result["h2d_bandwidth_bytes_per_s"] = options["h2d_bandwidth"]
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
