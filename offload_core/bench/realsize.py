"""Real-size benchmark for a machine with an accelerator (run by ``ci/gpu-check.sh``).

A Wan2.1-T2V-1.3B-config ``WanTransformer3DModel`` with random bf16 weights at a realistic video
latent (480x832, 81 frames), run the way ``WanPipeline`` runs it: a UniPC flow-matching scheduler,
and per denoising step two transformer calls (with and without the prompt: classifier-free
guidance) combined, then the scheduler's step; offload-core's steps inside ``handle.frozen()``,
as every pipeline call without step callbacks runs them. Variants: resident, layerwise offload at
prefetch depths 1 and 2, and diffusers' ``enable_group_offload(block_level,
num_blocks_per_group=1, use_stream=True)`` with ``record_stream`` False (its default) and True. It
reports step times and their ratios to resident, the host-to-device bandwidth a step achieves
against a plain pinned-memory copy, device peaks, pinned bytes, and whether each variant's final
latents equal the resident ones bit for bit.

Everything goes through the backend API, so the same code runs on any backend; ``--dry-run`` runs
it on the fake backend at tiny sizes, which is how CI keeps it working without a GPU (there
diffusers runs without streams, which it refuses on the CPU: one variant, ``use_stream=False``).

Weights are built on the meta device and then filled in place (a scaled uniform draw, so that
activations stay finite through 30 blocks): initialising 1.3 billion parameters the usual way would
take longer than the benchmark. Buffers computed at construction (the rotary tables) are taken
from a one-block instance of the same config, built normally.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import math
import time
from typing import Any

import torch
from torch import nn

from ..api import enable_offload
from ..device.plugins import get_backend

logger = logging.getLogger(__name__)

#: Wan2.1-T2V-1.3B's transformer config (diffusers' WanTransformer3DModel arguments)
WAN_1_3B: dict[str, Any] = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024,
)
#: the latent of a 480x832, 81-frame video (VAE: 4x temporal, 8x spatial compression) and a prompt
WAN_1_3B_INPUTS = {"latent": (1, 16, 21, 60, 104), "text": (1, 512, 4096)}
#: the same topology at sizes a CPU runs in seconds (--dry-run)
TINY: dict[str, Any] = dict(WAN_1_3B, num_attention_heads=2, attention_head_dim=16, text_dim=32, freq_dim=16,
                            ffn_dim=64, num_layers=4, rope_max_seq_len=64)
TINY_INPUTS = {"latent": (1, 16, 3, 8, 8), "text": (1, 8, 32)}
#: bytes of the plain pinned-to-device copy the achieved bandwidth is compared with
MEMCPY_BYTES = 1 << 30
#: classifier-free guidance scale (WanPipeline's default)
GUIDANCE = 5.0


def build_wan(config: dict[str, Any], dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> nn.Module:
    """A ``WanTransformer3DModel`` of ``config`` on the host, with random ``dtype`` weights."""
    from diffusers import WanTransformer3DModel

    with torch.device("meta"):
        model = WanTransformer3DModel(**config)
        # as from_pretrained(torch_dtype=dtype) loads it: the model's float32 modules stay float32
        keep = set(getattr(model, "_keep_in_fp32_modules", None) or ())
        for name, p in model.named_parameters():
            if not keep.intersection(name.split(".")):
                p.data = p.data.to(dtype)
    model = model.to_empty(device="cpu").eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:  # scaled like nn.Linear's default init: activations stay finite
                bound = 1.0 / math.sqrt(p.shape[1] * math.prod(p.shape[2:]))
                p.uniform_(-bound, bound, generator=generator)
            elif name.endswith("bias"):
                p.zero_()
            else:  # norm weights and learned tables
                p.fill_(1.0)
        twin = WanTransformer3DModel(**dict(config, num_layers=1))
        buffers = dict(twin.named_buffers())
        for name, b in model.named_buffers():
            source = buffers.get(name) if name in buffers else buffers.get(_as_first_block(name))
            if source is None:
                raise RuntimeError(f"buffer {name} has no counterpart in a one-block {type(model).__name__}")
            b.copy_(source)
    return model


def _as_first_block(name: str) -> str:
    parts = name.split(".")
    return ".".join(["blocks", "0", *parts[2:]]) if parts[0] == "blocks" else name


def make_inputs(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, seed: int = 1) -> dict[str, torch.Tensor]:
    """The initial latents, and the prompt's and the empty prompt's encodings."""
    generator = torch.Generator().manual_seed(seed)
    return {
        "latents": torch.randn(shapes["latent"], generator=generator).to(dtype),
        "cond": torch.randn(shapes["text"], generator=generator).to(dtype),
        "uncond": torch.randn(shapes["text"], generator=generator).to(dtype),
    }


def _to(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def scheduler(steps: int):
    """Wan's scheduler (UniPC on flow-matching sigmas, shift 3), set to ``steps`` steps."""
    from diffusers import UniPCMultistepScheduler

    made = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                                   num_train_timesteps=1000)
    made.set_timesteps(steps)
    return made


def denoise(backend, model: nn.Module, inputs: dict[str, torch.Tensor], steps: int,
            guidance: float = GUIDANCE) -> tuple[list[float], torch.Tensor]:
    """Seconds of each denoising step (the device synchronised after each), and the final latents
    (on the host): per step, the transformer with and without the prompt, their guided mix, the
    scheduler's step, as ``WanPipeline`` runs them."""
    schedule = scheduler(steps)
    latents = inputs["latents"]
    times = []
    with torch.no_grad():
        backend.synchronize()
        for t in schedule.timesteps:
            start = time.perf_counter()
            timestep = t.expand(latents.shape[0]).to(latents.device)
            cond = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=inputs["cond"],
                         return_dict=False)[0]
            uncond = model(hidden_states=latents, timestep=timestep, encoder_hidden_states=inputs["uncond"],
                           return_dict=False)[0]
            noise = uncond + guidance * (cond - uncond)
            latents = schedule.step(noise, t, latents, return_dict=False)[0]
            backend.synchronize()
            times.append(time.perf_counter() - start)
    return times, latents.detach().to("cpu")


def pinned_copy_bandwidth(backend, nbytes: int, repeats: int = 3) -> float:
    """Bytes per second of one plain pinned-host-to-device copy (the best of ``repeats``)."""
    src = backend.empty_pinned(nbytes)
    dst = backend.empty_device(nbytes)
    stream = backend.new_stream()
    best = math.inf
    for i in range(repeats + 1):
        backend.synchronize()
        start = time.perf_counter()
        backend.copy_async(dst, src, stream)
        stream.synchronize()
        if i:  # the first copy warms the path up
            best = min(best, time.perf_counter() - start)
    del src, dst
    backend.empty_host_cache()
    return nbytes / best


def run(backend, config: dict[str, Any], shapes: dict[str, tuple[int, ...]], steps: int = 3,
        memcpy_bytes: int = MEMCPY_BYTES) -> dict[str, Any]:
    """Every variant on ``backend``: one warm-up step, then ``steps`` timed denoising steps (the
    scheduler set to all of them); see the module docstring."""
    dtype = torch.bfloat16
    device = backend.device()
    model = build_wan(config, dtype)
    inputs = _to(make_inputs(shapes, dtype), device)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    results: dict[str, Any] = {}

    def measure(name: str, denoiser: nn.Module, handle=None) -> torch.Tensor:
        backend.synchronize()
        base = backend.memory_allocated()
        backend.reset_peak_memory_stats()
        before = handle.stats() if handle is not None else None  # enable's own copies excluded
        with handle.frozen() if handle is not None else contextlib.nullcontext():
            times, out = denoise(backend, denoiser, inputs, steps + 1)
        times = times[1:]  # the first step pays the first loads and the kernels' first launch
        entry: dict[str, Any] = {"step_s": times, "median_step_s": sorted(times)[len(times) // 2],
                                 "device_peak_bytes": backend.max_memory_allocated() - base}
        if handle is not None:
            stats = handle.stats()
            per_step = (stats["h2d_bytes"] - before["h2d_bytes"]) / (steps + 1)  # the warm-up step included
            entry.update(h2d_bytes_per_step=per_step,
                         h2d_copies_per_step=(stats["h2d_copies"] - before["h2d_copies"]) / (steps + 1),
                         prefetch_misses=stats["prefetch_misses"], pinned_host_bytes=stats["pinned_host_bytes"],
                         host_bytes=stats["host_bytes"], backend_pinned_bytes=backend.pinned_memory_allocated(),
                         achieved_h2d_bytes_per_s=per_step / entry["median_step_s"])
        results[name] = entry
        logger.info("%s: %.3f s per step", name, entry["median_step_s"])
        return out

    resident = copy.deepcopy(model).to(device)
    expected = measure("resident", resident)
    del resident
    for depth in (1, 2):
        handle = enable_offload(model, enable_layerwise_offload=True, prefetch_depth=depth, backend=backend)
        try:
            out = measure(f"layerwise_depth{depth}", model, handle)
            results[f"layerwise_depth{depth}"]["exact"] = bool(torch.equal(out, expected))
        finally:
            handle.disable()
    streams = device.type != "cpu"  # diffusers' streams need a device whose backend implements them
    for record_stream in (False, True) if streams else (False,):
        name = f"diffusers_group_offload{'_record_stream' if record_stream else ''}"
        offloaded = copy.deepcopy(model)
        offloaded.enable_group_offload(onload_device=device, offload_type="block_level", num_blocks_per_group=1,
                                       use_stream=streams, record_stream=record_stream)
        out = measure(name, offloaded)
        results[name].update(exact=bool(torch.equal(out, expected)), use_stream=streams, record_stream=record_stream)
        del offloaded

    memcpy = pinned_copy_bandwidth(backend, min(memcpy_bytes, max(weight_bytes, 1 << 20)))
    resident_s = results["resident"]["median_step_s"]
    for name, entry in results.items():
        entry["ratio_to_resident"] = entry["median_step_s"] / resident_s
        if "achieved_h2d_bytes_per_s" in entry:
            entry["achieved_to_memcpy"] = entry["achieved_h2d_bytes_per_s"] / memcpy
    return {
        "backend": backend.name,
        "device": str(device),
        "config": {k: list(v) if isinstance(v, tuple) else v for k, v in config.items()},
        "inputs": {k: list(v) for k, v in shapes.items()},
        "dtype": str(dtype),
        "weight_bytes": weight_bytes,
        "steps": steps,
        "call_pattern": "per step: transformer(cond), transformer(uncond), guidance, UniPC step; offloaded ones "
                        "inside handle.frozen()",
        "pinned_memcpy_bytes_per_s": memcpy,
        "variants": results,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m offload_core.bench.realsize", description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", help="backend name (default: auto-detection)")
    parser.add_argument("--dry-run", action="store_true", help="the fake backend at tiny sizes (no accelerator needed)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant, after one warm-up step")
    parser.add_argument("--out", required=True, metavar="FILE.json", help="where to write the results")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.dry_run:
        torch.set_num_threads(1)  # tiny ops: more threads only contend
        backend = get_backend("fake", chaos=False)
        result = run(backend, TINY, TINY_INPUTS, steps=min(args.steps, 2), memcpy_bytes=1 << 20)
    else:
        backend = get_backend(args.backend)
        result = run(backend, WAN_1_3B, WAN_1_3B_INPUTS, steps=args.steps)
    result["dry_run"] = args.dry_run
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
