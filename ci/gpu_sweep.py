"""The two measurements of ci/gpu_check.py that decide a step's time: where streaming stops being
free (the crossover sweep), and what the host spends per block when nothing else is in the way
(host cost per block). Both run the same code on the device and, in a dry run, on the simulator
at tiny sizes, through a probe of ci/gpu_probe.py.

**Crossover sweep.** A stack of FLUX.2-dev single-stream blocks (diffusers'
``Flux2SingleTransformerBlock``, dim 6144, 48 heads, bf16) and one of Wan2.1-14B blocks
(``WanTransformerBlock``, dim 5120, ffn 13824, 40 heads, 512 text tokens; the modules Wan keeps
in float32 kept so) at 1k, 4.6k, 17k and 64k tokens: resident, layerwise at prefetch depths 1
and 2 and the planner at a fixed budget (room for half the blocks and one more, plus the
activations the resident run measured at the largest point), every offloaded step inside
``handle.frozen()`` as a pipeline runs them. Per point: the step time and its ratio to resident, the bound max(resident step,
bytes copied per step / the measured pinned host-to-device bandwidth), efficiency = bound /
measured, the compute stream's idle time in one profiled step (its trace is kept), and whether
the output equals the resident one bit for bit.

**Host cost per block.** A stack of small bf16 Wan blocks (dim 256, 16 tokens, 16 text tokens:
each block computes and copies in microseconds, so the host's work per block decides the step),
eager and with each block compiled in place (regional compile): resident, offload-core (layerwise
depth 1, inside ``frozen()``), and diffusers' ``apply_group_offloading(block_level,
num_blocks_per_group=1, use_stream=True)`` with ``record_stream`` False (its default, which makes
the host wait for the compute stream at every group) and True. Per variant: the calling thread's
CPU time per block, the compute stream's idle time per block and the runtime calls per block
(copies, event records and waits, synchronisations) from one profiled step.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

# -- the blocks ----------------------------------------------------------------------------------------

#: FLUX.2-dev's single-stream block (Flux2Transformer2DModel: 48 heads of 128, mlp_ratio 3)
FLUX2_SINGLE = {"dim": 6144, "num_attention_heads": 48, "attention_head_dim": 128, "mlp_ratio": 3.0}
#: Wan2.1-T2V-14B's block (WanTransformer3DModel: dim 5120, ffn 13824, 40 heads)
WAN_14B = {"dim": 5120, "ffn_dim": 13824, "num_heads": 40, "qk_norm": "rms_norm_across_heads",
           "cross_attn_norm": True, "eps": 1e-6}
#: a small Wan block whose compute and copy take microseconds: the host decides its step
WAN_SMALL = {"dim": 256, "ffn_dim": 1024, "num_heads": 2, "qk_norm": "rms_norm_across_heads",
             "cross_attn_norm": True, "eps": 1e-6}
#: the modules Wan keeps in float32 when loaded in bf16 (WanTransformer3DModel._keep_in_fp32_modules)
WAN_FP32 = ("scale_shift_table", "norm1", "norm2", "norm3")


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What one run of the sweeps measures: the real one, or the dry run's tiny one."""

    flux2: dict[str, Any]
    flux2_blocks: int
    wan: dict[str, Any]
    wan_blocks: int
    wan_text_tokens: int
    tokens: tuple[int, ...]
    host: dict[str, Any]
    host_blocks: int
    host_tokens: int
    warmup: int
    steps: int
    host_steps: int
    compile_backend: str


GPU = Sizes(FLUX2_SINGLE, 8, WAN_14B, 4, 512, (1024, 4608, 17408, 65536), WAN_SMALL, 32, 16,
            warmup=1, steps=2, host_steps=20, compile_backend="inductor")
DRY = Sizes({"dim": 64, "num_attention_heads": 2, "attention_head_dim": 32, "mlp_ratio": 3.0}, 4,
            dict(WAN_SMALL, dim=64, ffn_dim=128), 4, 8, (8, 32, 128, 512), dict(WAN_SMALL, dim=32, ffn_dim=64), 8, 16,
            warmup=1, steps=1, host_steps=3, compile_backend="eager")


class Stack(nn.Module):
    """``n`` blocks called in a row, the way a DiT's block loop calls them."""

    def __init__(self, blocks: list[nn.Module], call: Callable[..., torch.Tensor]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self._call = call

    def forward(self, x: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self._call(block, x, **inputs)
        return x


def _flux2_call(block: nn.Module, x: torch.Tensor, temb_mod: torch.Tensor) -> torch.Tensor:
    return block(x, None, temb_mod)


def _wan_call(block: nn.Module, x: torch.Tensor, encoder_hidden_states: torch.Tensor,
              temb: torch.Tensor) -> torch.Tensor:
    return block(x, encoder_hidden_states, temb, None)


def build(kind: str, config: dict[str, Any], n: int, device: torch.device, seed: int = 0) -> Stack:
    """A stack of ``n`` blocks of ``kind`` ("flux2" or "wan") with random bf16 weights (float32
    where Wan keeps them so), made on the meta device and filled in place on ``device``: filling
    billions of weights the usual way on the host would take longer than the check."""
    from diffusers.models.transformers.transformer_flux2 import Flux2SingleTransformerBlock
    from diffusers.models.transformers.transformer_wan import WanTransformerBlock

    with torch.device("meta"):
        if kind == "flux2":
            stack = Stack([Flux2SingleTransformerBlock(**config) for _ in range(n)], _flux2_call)
        else:
            stack = Stack([WanTransformerBlock(**config) for _ in range(n)], _wan_call)
    for name, p in stack.named_parameters():
        keep = kind == "wan" and set(WAN_FP32).intersection(name.split("."))
        p.data = p.data.to(torch.float32 if keep else torch.bfloat16)
    stack = stack.to_empty(device=device).eval()
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in stack.named_parameters():
            if p.dim() >= 2 and not name.endswith("scale_shift_table"):  # scaled like nn.Linear's init
                bound = 1.0 / math.sqrt(p.shape[1] * math.prod(p.shape[2:]))
                p.uniform_(-bound, bound, generator=generator)
            elif name.endswith("scale_shift_table"):
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=generator)
            else:
                p.fill_(1.0) if "norm" in name else p.zero_()
    return stack


def inputs(kind: str, config: dict[str, Any], tokens: int, text_tokens: int, device: torch.device,
           seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator(device=device).manual_seed(seed)
    dim = config["dim"]

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=torch.bfloat16)

    if kind == "flux2":
        return {"x": rand(1, tokens, dim), "temb_mod": rand(1, 3 * dim)}
    return {"x": rand(1, tokens, dim), "encoder_hidden_states": rand(1, text_tokens, dim), "temb": rand(1, 6, dim)}


def weight_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- the crossover sweep ---------------------------------------------------------------------------------


def _steps(backend, model: nn.Module, feed: dict[str, torch.Tensor], count: int) -> tuple[float, torch.Tensor]:
    """Mean seconds of ``count`` forwards issued back to back (the device synchronised before the
    first and after the last), and the last output."""
    backend.synchronize()
    start = time.perf_counter()
    out = None
    for _ in range(count):
        out = model(**feed)
    backend.synchronize()
    return (time.perf_counter() - start) / max(count, 1), out


def _point(backend, probe, model: nn.Module, handle, feed: dict[str, torch.Tensor], sizes: Sizes,
           trace: Path) -> tuple[dict[str, Any], torch.Tensor]:
    """One variant at one token count: warm-up, timed steps, one profiled step (its trace kept);
    the figures and the output."""
    with (handle.frozen() if handle is not None else contextlib.nullcontext()):
        _steps(backend, model, feed, sizes.warmup)
        before = handle.stats()["h2d_bytes"] if handle is not None else 0
        seconds, out = _steps(backend, model, feed, sizes.steps)
        moved = (handle.stats()["h2d_bytes"] - before) / sizes.steps if handle is not None else 0
        profiled = probe.profile(lambda: model(**feed), trace)
    return {"step_s": seconds, "h2d_bytes_per_step": moved, **profiled.summary()}, out


def crossover(backend, probe, out: Path, sizes: Sizes, h2d_bytes_per_s: float) -> dict[str, Any]:
    """The sweep over both stacks; see the module docstring. ``h2d_bytes_per_s``: the pinned
    host-to-device bandwidth the bound divides by."""
    import offload_core

    device = backend.device()
    models = {"flux2-single": ("flux2", sizes.flux2, sizes.flux2_blocks),
              "wan-14b": ("wan", sizes.wan, sizes.wan_blocks)}
    points: dict[str, dict[str, Any]] = {}
    with torch.no_grad():
        for label, (kind, config, n) in models.items():
            model = build(kind, config, n, device)
            weights = weight_bytes(model)
            feeds = {t: inputs(kind, config, t, sizes.wan_text_tokens, device) for t in sizes.tokens}
            resident: dict[int, dict[str, Any]] = {}
            expected: dict[int, torch.Tensor] = {}
            activations = 0
            for tokens, feed in feeds.items():
                backend.synchronize()
                backend.reset_peak_memory_stats()
                base = backend.memory_allocated()
                resident[tokens], output = _point(backend, probe, model, None, feed, sizes,
                                                  out / f"trace-{label}-{tokens}-resident.json")
                expected[tokens] = output.detach().to("cpu")
                resident[tokens]["exact"] = True
                activations = max(activations, backend.max_memory_allocated() - base)
            model = model.to("cpu")
            largest_block = max(weight_bytes(b) for b in model.blocks)
            activations = max(activations, largest_block)  # the fake's activations are host memory: not seen
            budget = (n // 2 + 1) * largest_block + activations  # room for half the blocks and one more
            variants: dict[str, dict[str, Any]] = {
                "layerwise depth 1": {"enable_layerwise_offload": True, "prefetch_depth": 1},
                "layerwise depth 2": {"enable_layerwise_offload": True, "prefetch_depth": 2},
                "planner": {"device_memory": budget, "activation_memory": activations},
            }
            measured: dict[str, dict[int, dict[str, Any]]] = {"resident": resident}
            plans: dict[str, str] = {}
            for name, options in variants.items():
                handle = offload_core.enable_offload(model, backend=backend, **options)
                try:
                    plans[name] = str(handle.plan).splitlines()[0]
                    measured[name] = {}
                    for tokens, feed in feeds.items():
                        figures, output = _point(backend, probe, model, handle, feed, sizes,
                                                 out / f"trace-{label}-{tokens}-{name.replace(' ', '-')}.json")
                        figures["exact"] = bool(torch.equal(output.detach().to("cpu"), expected[tokens]))
                        measured[name][tokens] = figures
                        del output
                finally:
                    handle.disable()
            del model
            for tokens in sizes.tokens:
                base = measured["resident"][tokens]
                row: dict[str, Any] = {}
                for name, runs in measured.items():
                    run = runs[tokens]
                    bound = max(base["step_s"], run["h2d_bytes_per_step"] / h2d_bytes_per_s)
                    row[name] = dict(run, step_ratio=run["step_s"] / base["step_s"], bound_s=bound,
                                     efficiency=bound / run["step_s"])
                points[f"{label} {tokens}"] = {"model": label, "tokens": tokens, "blocks": n,
                                               "weight_bytes": weights, "variants": row}
            points[f"{label} plans"] = {"planner_budget_bytes": budget, "plans": plans}
    return points


# -- host cost per block ------------------------------------------------------------------------------------


@contextlib.contextmanager
def _diffusers_streams_on(simulated: bool, calls) -> Iterator[None]:
    """On the simulator, diffusers' stream path made to run on the host: its device module's
    streams (``torch.cpu`` has no synchronisation) replaced by ones that log a
    ``cudaStreamSynchronize`` each time diffusers waits for one; ``record_stream`` (which CPU
    tensors refuse) a no-op, as CPU memory has no stream-ordered allocator to tell; ``pin_memory``
    the tensor itself, as the fake's pinned memory is plain memory. On the device, nothing
    changes."""
    if not simulated:
        yield
        return
    from diffusers.hooks import group_offloading

    real = group_offloading.TorchDeviceBackend

    class LoggedStream:
        def synchronize(self) -> None:
            start = time.perf_counter_ns()
            with calls._lock:
                calls.log.append(("cudaStreamSynchronize", start, time.perf_counter_ns()))

    class Streams:
        def __init__(self, device: Any) -> None:
            self._module = real(device)

        def __getattr__(self, name: str) -> Any:
            return getattr(self._module, name)

        Stream = LoggedStream

        def stream(self, stream: Any) -> contextlib.AbstractContextManager:
            return contextlib.nullcontext(stream)

        def current_stream(self) -> LoggedStream:
            return LoggedStream()

    record_stream, pin_memory = torch.Tensor.record_stream, torch.Tensor.pin_memory
    group_offloading.TorchDeviceBackend = Streams
    torch.Tensor.record_stream = lambda self, stream: None
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    try:
        yield
    finally:
        group_offloading.TorchDeviceBackend = real
        torch.Tensor.record_stream, torch.Tensor.pin_memory = record_stream, pin_memory


def _diffusers_group_offload(model: nn.Module, device: torch.device, record_stream: bool, simulated: bool) -> None:
    """``apply_group_offloading(block_level, one block per group, use_stream=True)``. diffusers
    refuses streams for a CPU onload device, so the simulator's variant builds the same
    configuration and applies it through the function the public one calls."""
    from diffusers.hooks import group_offloading

    if not simulated:
        group_offloading.apply_group_offloading(model, onload_device=device, offload_type="block_level",
                                                num_blocks_per_group=1, use_stream=True, record_stream=record_stream)
        return
    config = group_offloading.GroupOffloadingConfig(
        onload_device=device, offload_device=torch.device("cpu"),
        offload_type=group_offloading.GroupOffloadingType.BLOCK_LEVEL,
        num_blocks_per_group=1, non_blocking=True, stream=group_offloading.TorchDeviceBackend(device).Stream(),
        record_stream=record_stream, low_cpu_mem_usage=False, offload_to_disk_path=None, block_modules=None,
        exclude_kwargs=None)
    group_offloading._apply_group_offloading(model, config)


def host_cost(backend, probe, calls, out: Path, sizes: Sizes) -> dict[str, Any]:
    """Host CPU time, compute-stream idle time and runtime calls per block; see the module docstring."""
    import offload_core

    device = backend.device()
    n = sizes.host_blocks
    template = build("wan", sizes.host, n, torch.device("cpu"))
    feed = inputs("wan", sizes.host, sizes.host_tokens, sizes.host_tokens, device)
    results: dict[str, Any] = {}
    for compiled in (False, True):
        mode = "regional compile" if compiled else "eager"
        expected: torch.Tensor | None = None  # the resident output of the same mode (compiled kernels differ)
        for variant in ("resident", "offload-core", "diffusers record_stream=False", "diffusers record_stream=True"):
            model = copy.deepcopy(template)
            handle = None
            with _diffusers_streams_on(probe.simulated, calls):
                if variant == "resident":
                    model = model.to(device)
                elif variant == "offload-core":
                    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
                else:
                    _diffusers_group_offload(model, device, variant.endswith("True"), probe.simulated)
                if compiled:
                    for block in model.blocks:
                        block.compile(backend=sizes.compile_backend)
                trace = out / (f"trace-host-{'compiled' if compiled else 'eager'}-{variant.split()[0]}"
                               f"{'-record' if variant.endswith('True') else ''}.json")
                try:
                    figures, output = _host_point(backend, probe, model, handle, feed, sizes, n, trace)
                finally:
                    if handle is not None:
                        handle.disable()
            if expected is None:
                expected = output
            results[f"{mode}, {variant}"] = dict(figures, exact=bool(torch.equal(output, expected)))
            del model
    return results


def _host_point(backend, probe, model: nn.Module, handle, feed: dict[str, torch.Tensor], sizes: Sizes, n: int,
                trace: Path) -> tuple[dict[str, Any], torch.Tensor]:
    with torch.no_grad(), (handle.frozen() if handle is not None else contextlib.nullcontext()):
        for _ in range(sizes.warmup + 1):  # the compiled variants compile in the first
            model(**feed)
        backend.synchronize()
        cpu, wall = time.thread_time_ns(), time.perf_counter()
        for _ in range(sizes.host_steps):
            out = model(**feed)
        backend.synchronize()
        cpu, wall = time.thread_time_ns() - cpu, time.perf_counter() - wall
        profiled = probe.profile(lambda: model(**feed), trace)
    summary = profiled.summary()
    return {"host_cpu_us_per_block": cpu / 1e3 / sizes.host_steps / n, "step_s": wall / sizes.host_steps,
            "compute_idle_us_per_block": summary["compute_idle_us"] / n,
            "runtime_calls_per_block": {k: v / n for k, v in summary["runtime_calls"].items()},
            "trace": summary["trace"], "simulated": summary["simulated"]}, out.detach().to("cpu")


# -- what it costs on an H200 ------------------------------------------------------------------------------

#: what the estimate assumes of an H200 (SXM): dense bf16 matmul throughput reached by large GEMMs
#: and attention (about 60% of the 989 TFLOPS peak), pinned host-to-device bandwidth over a PCIe
#: 5.0 x16 link, and the host's per-block cost of a block call and of our hooks
H200_FLOPS = 600e12
H200_H2D = 50e9
HOST_BLOCK_S = 150e-6


def block_flops(kind: str, config: dict[str, Any], tokens: int, text_tokens: int) -> float:
    """Floating-point operations of one block's forward at ``tokens`` (matmuls and attention)."""
    dim = config["dim"]
    if kind == "flux2":
        hidden = int(dim * config["mlp_ratio"])
        params = dim * (3 * dim + 2 * hidden) + (dim + hidden) * dim
        return 2 * params * tokens + 4 * tokens * tokens * dim
    params = 8 * dim * dim + 2 * dim * config["ffn_dim"]  # self- and cross-attention projections, the FFN
    return 2 * params * tokens + 4 * tokens * tokens * dim + 4 * tokens * text_tokens * dim


def block_bytes(kind: str, config: dict[str, Any]) -> int:
    dim = config["dim"]
    if kind == "flux2":
        hidden = int(dim * config["mlp_ratio"])
        return 2 * (dim * (3 * dim + 2 * hidden) + (dim + hidden) * dim)
    return 2 * (8 * dim * dim + 2 * dim * config["ffn_dim"])


def estimate_seconds(sizes: Sizes = GPU) -> dict[str, float]:
    """Seconds the two sweeps take on an H200, from the work they do: per point, the resident
    variant's steps at compute speed and each offloaded one's at max(compute, copy); the warm-up,
    timed and profiled steps; one pinning of the weights per offloaded variant (a host copy at
    about 10 GB/s); a second per profiled step for the profiler."""
    steps = sizes.warmup + sizes.steps + 1
    total = {"crossover": 0.0, "host cost": 0.0}
    for kind, config, n in (("flux2", sizes.flux2, sizes.flux2_blocks), ("wan", sizes.wan, sizes.wan_blocks)):
        weights = n * block_bytes(kind, config)
        total["crossover"] += weights / 5e9 * 4  # build, move home, pack and pin for each offloaded variant
        for tokens in sizes.tokens:
            compute = n * block_flops(kind, config, tokens, sizes.wan_text_tokens) / H200_FLOPS
            copy_s = weights / H200_H2D
            total["crossover"] += steps * (compute + 2 * max(compute, copy_s) + max(compute, copy_s / 2)) + 4 * 1.0
    per_step = sizes.host_blocks * HOST_BLOCK_S * 2
    total["host cost"] = 8 * (sizes.warmup + 1 + sizes.host_steps) * per_step + 8 * 1.0 + 40.0  # 40 s: compiling
    return total
