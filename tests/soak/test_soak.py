"""A server's week in miniature: one offloaded pipeline called over and over (docs/design.md, "What
moves when"), with requests of two sizes, a request cancelled every twentieth of the run (an
exception raised from ``callback_on_step_end``) and, every tenth, the DiT called directly with
autograd on and no backward. Every output equals the same request without offload, and the
process's RSS, the handle's pinned bytes, the device bytes, the open file descriptors, the
threads and the live tensor objects stay flat once warmed up.

CI runs a short soak (``CALLS`` pipeline calls, seconds); ``OFFLOAD_CORE_SOAK_CALLS=1000`` runs
the long one (a cancel every 50 calls, a grad-mode call every 100), about three minutes here.

Flat means: every count (pinned and device bytes, descriptors, threads, tensors) never exceeds,
after warm-up, what it was at the end of warm-up; RSS, which the allocator moves by itself, may
not grow by more than ``RSS_TOLERANCE`` along its least-squares line over the second half of the
run (a leak of 16 KiB per call is caught over 500 calls, one graph kept per grad-mode call always:
the tensor count moves by whole tensors)."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref

import psutil
import pytest
import torch

import offload_core
from offload_core.hostmem.machine import return_free_memory
from offload_core.tiny import build_pipeline

from helpers import chaos_backend

pytestmark = pytest.mark.slow

CALLS = int(os.environ.get("OFFLOAD_CORE_SOAK_CALLS", "60"))
RSS_TOLERANCE = 8 * 2**20


class Cancelled(Exception):
    """What a client's cancellation looks like to the pipeline: its step callback raises."""


def _cancel(pipe, step, timestep, callback_kwargs):
    raise Cancelled(f"request cancelled at step {step}")


def _figures(handle, backend) -> dict[str, int]:
    return_free_memory()
    return {
        "rss": psutil.Process().memory_info().rss,
        "pinned": handle.stats()["pinned_host_bytes"],
        "device": backend.memory_allocated(),
        "descriptors": len(os.listdir("/proc/self/fd")),
        "threads": threading.active_count(),
        "os threads": len(os.listdir("/proc/self/task")),
    }


def _tensors() -> int:
    """Live tensor objects (a second's walk over every object: taken twice)."""
    gc.collect()
    return sum(isinstance(o, torch.Tensor) for o in gc.get_objects())


def _dit_inputs(tiny) -> dict:
    """The DiT's keyword arguments in a pipeline call, kept for the grad-mode calls."""
    captured: dict = {}

    def keep(_module, _args, kwargs):
        if not captured:
            captured.update({k: v.detach().clone() if torch.is_tensor(v) else v for k, v in kwargs.items()})

    hook = tiny.pipe.transformer.register_forward_pre_hook(keep, with_kwargs=True)
    tiny.run()
    hook.remove()
    return captured


def _first(output):
    return output[0] if isinstance(output, tuple) else output


def _slope(values: list[float]) -> float:
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / sum((x - mean_x) ** 2 for x in range(n))


def test_a_pipeline_called_over_and_over_stays_flat():
    cancel_every, grad_every = max(CALLS // 20, 2), max(CALLS // 10, 3)
    warmup = max(CALLS // 5, 10)
    tiny, reference = build_pipeline("flux2"), build_pipeline("flux2")
    sizes = (tiny.call_kwargs["height"], 2 * tiny.call_kwargs["height"])
    expected = {size: reference.run(seed=size, height=size, width=size) for size in sizes}
    inputs = _dit_inputs(reference)
    with torch.no_grad():
        grad_expected = reference.pipe.transformer(**inputs)[0]
    del reference

    backend = chaos_backend()
    handle = offload_core.enable_offload(tiny.pipe, backend=backend, enable_layerwise_offload=True)
    dit = tiny.pipe.transformer
    block_outputs: list = []  # each block's output in a grad-mode call, weakly: gone once its output is
    for blocks in (dit.transformer_blocks, dit.single_transformer_blocks):
        for block in blocks:
            block.register_forward_hook(lambda m, a, out: block_outputs.append(weakref.ref(_first(out))))
    samples: list[dict[str, int]] = []
    started = time.perf_counter()
    for call in range(1, CALLS + 1):
        size = sizes[call % 2]
        if call % cancel_every == 0:
            with pytest.raises(Cancelled):
                tiny.run(seed=size, height=size, width=size, callback_on_step_end=_cancel)
        else:
            assert torch.equal(tiny.run(seed=size, height=size, width=size), expected[size]), f"call {call}"
        if call % grad_every == 0:  # a leaf input: the frozen DiT records a graph for its gradient
            with torch.enable_grad():
                out = dit(**{**inputs, "hidden_states": inputs["hidden_states"].requires_grad_()})[0]
            assert out.requires_grad and torch.equal(out.detach(), grad_expected), f"grad-mode call after {call}"
            del out
            alive = [ref for ref in block_outputs if ref() is not None]
            assert not alive, f"{len(alive)} block outputs of the grad-mode call after {call} outlive its output"
        block_outputs.clear()
        samples.append(_figures(handle, backend))
        if call == warmup:
            tensors = _tensors()
    elapsed = time.perf_counter() - started
    samples[-1]["tensors"], samples[warmup - 1]["tensors"] = _tensors(), tensors
    handle.disable()

    settled = samples[warmup - 1]
    report = {key: (settled[key], max(s.get(key, 0) for s in samples[warmup:])) for key in settled}
    print(f"\nsoak: {CALLS} calls in {elapsed:.1f} s; (end of warm-up, max after) {report}")
    for key in ("pinned", "device", "descriptors", "threads", "os threads", "tensors"):
        grown = [(k, s[key]) for k, s in enumerate(samples[warmup:], start=warmup + 1) if s.get(key, 0) > settled[key]]
        assert not grown, f"{key} grew after warm-up ({settled[key]} at call {warmup}): {grown[:5]}"
    half = samples[len(samples) // 2:]
    growth = _slope([s["rss"] for s in half]) * len(half)
    print(f"soak: RSS along its fitted line over the last {len(half)} calls: {growth / 2**20:+.2f} MiB")
    assert growth <= RSS_TOLERANCE, f"RSS grows {growth / 2**20:.1f} MiB over the last {len(half)} calls"
