"""Forwards with autograd on and no backward (a validation pass or a sampler that calls the model
without ``torch.no_grad``) cost what they cost without offload (docs/design.md, "What moves
when"): the graph and everything offload attached to it are freed with the output, without a
garbage collection; process memory and device bytes stay flat over calls; model-level's device
copy is released at the component's next load and at ``disable()``, also while a graph that saved
it is alive; ``disable()`` and ``del`` bring the device back to where it was."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref

import psutil
import pytest
import torch
import torch.multiprocessing as mp

import offload_core
from offload_core.hostmem.machine import return_free_memory

from contract_models import ENABLE_OPTIONS
from helpers import chaos_backend, free_port
from stacks import StackSpec, build_stack

BLOCKS = 12
D = 64
TOKENS = 2048  # one call's graph holds ~1.5 MiB per block: ~18 MiB, what a leak would add per call
CALLS = 12
WARMUP = 4
#: RSS growth over the calls after warm-up beyond the same model's without offload. A leaked graph
#: adds ~18 MiB per call (~140 MiB over these calls); the allocator's own noise is a few MiB.
RSS_SLACK = 24 * 2**20



def build():
    return build_stack(StackSpec(d=D, layer_dtypes=[[torch.float32]] * BLOCKS, seed=3))


def inputs():
    return torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(1))


def rss() -> int:
    return_free_memory()
    return psutil.Process().memory_info().rss


@contextlib.contextmanager
def gc_off():
    """What is freed inside is freed by reference counts alone: a cycle would stay."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def grad_calls(model, x, backend=None) -> tuple[list[int], list[int]]:
    """``CALLS`` forwards with autograd on, each output dropped: RSS and device bytes after each.
    Every block's output (which the next block's graph saves) must be gone once the output is."""
    outputs: list = []
    hooks = [block.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out))) for block in model.blocks]
    sizes, device = [], []
    with gc_off():
        for _ in range(CALLS):
            out = model(x)
            assert out.requires_grad
            del out
            alive = sum(ref() is not None for ref in outputs)
            assert not alive, f"{alive} block outputs outlive the output they were computed for"
            outputs.clear()
            sizes.append(rss())
            device.append(backend.memory_allocated() if backend is not None else 0)
    for hook in hooks:
        hook.remove()
    return sizes, device


def growth(sizes: list[int]) -> int:
    return max(sizes[WARMUP:]) - sizes[WARMUP - 1]


@pytest.mark.fake_only  # process RSS measures the fake device's memory too
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_grad_mode_forwards_without_backward_stay_flat(strategy):
    model, x = build(), inputs()
    reference = copy.deepcopy(model)
    baseline, _ = grad_calls(reference, x)
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, backend=backend, **ENABLE_OPTIONS[strategy])
    sizes, device = grad_calls(model, x, backend)
    assert len(set(device[WARMUP - 1:])) == 1, f"device bytes grow over calls: {device}"
    assert growth(sizes) <= growth(baseline) + RSS_SLACK, (
        f"RSS grew {growth(sizes) / 2**20:.1f} MiB over {CALLS - WARMUP} calls, "
        f"{growth(baseline) / 2**20:.1f} MiB without offload"
    )
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    handle.disable()
    del model, handle
    assert backend.memory_allocated() == 0, "device bytes left after disable() and del"


def test_model_level_releases_the_device_copy_a_live_graph_saved_at_the_next_load_and_at_disable():
    """A sampler that calls the model without ``no_grad`` and feeds each output back chains the
    graphs: without offload they hold activations only, the weights being the model's own. Each
    call's device copy is released when the next call loads the component, so the device holds one
    copy, not one per call; a backward through the whole chain reads the weights again (reloaded,
    and checked against their versions) and gives the gradients computed without offload; at
    ``disable()`` the copy is released and a backward then raises, naming it."""
    model, x = build(), inputs()
    reference = copy.deepcopy(model)
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, backend=backend, enable_cpu_offload=True)
    one_copy = handle.stats()["host_bytes"]
    results = []
    for m in (model, reference):
        y = x
        for _ in range(4):
            y = y + 0.1 * m(y)
            assert backend.memory_allocated() <= one_copy, "a chained graph keeps a device copy per call"
        y.square().mean().backward()
        results.append({n: p.grad for n, p in m.named_parameters()})
        del y
        assert backend.memory_allocated() == 0, "the backward left the component it reloaded on the device"
    assert results[0].keys() == results[1].keys()
    assert all(torch.equal(results[0][n], results[1][n]) for n in results[1]), "weight gradients differ"
    with torch.no_grad():
        assert torch.equal(model(x), reference(x)), "the model after a backward that reloaded weights"
    loss = model(x).square().mean()
    assert backend.memory_allocated() > 0
    handle.disable()
    assert backend.memory_allocated() == 0, "disable() leaves the device copy a live graph saved"
    with pytest.raises(RuntimeError, match="disable"):
        loss.backward()


def test_model_level_backward_after_a_repack_raises_naming_it_and_the_model_runs_on():
    """A backward whose device copy was released (the model was called again) after a structural
    change re-packed the model cannot read the weights as its forward laid them out: it raises,
    as layerwise offload does, and the model then runs as the same model without offload."""
    model, x = build(), inputs()
    reference = copy.deepcopy(model)
    handle = offload_core.enable_offload(model, backend=chaos_backend(), enable_cpu_offload=True)
    loss = model(x).square().mean()
    model(x)  # the component's next load releases the copy the first graph saved
    for m in (model, reference):
        m.blocks[0].register_buffer("extra", torch.zeros(1))  # a structural change: re-packed at the next use
    with pytest.raises(RuntimeError, match="re-packed"):
        loss.backward()
    assert all(p.grad is None for p in model.parameters()), "a gradient computed from the new layout"
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    handle.disable()


def test_a_released_saved_weight_read_outside_backward_is_a_copy_and_leaves_nothing_on_the_device():
    """``grad_fn._saved_mat2`` read after the component's next load released the copy it views:
    the weight as the forward used it, as a copy, and the component back home at once."""
    model, x = build(), inputs()
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, backend=backend, enable_cpu_offload=True)
    y = model(x)
    model(x)
    saved = y.grad_fn._saved_mat2  # the head's weight.t(), an mm without bias
    assert torch.equal(saved, model.head.weight.t())
    assert backend.memory_allocated() == 0, "reading a saved weight left the component on the device"
    del y
    handle.disable()


def _rank(rank: int, port: int) -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/ helpers in the spawned process
    torch.set_num_threads(1)
    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    backend.init_process_group(rank, 2, f"tcp://127.0.0.1:{port}")

    model, x = build(), inputs()
    reference = copy.deepcopy(model)
    baseline, _ = grad_calls(reference, x)
    handle = offload_core.enable_offload(model, backend=backend, enable_distributed_layerwise_offload=True)
    sizes, device = grad_calls(model, x, backend)
    assert len(set(device[WARMUP - 1:])) == 1, f"rank {rank}: device bytes grow over calls: {device}"
    assert growth(sizes) <= growth(baseline) + RSS_SLACK, (
        f"rank {rank}: RSS grew {growth(sizes) / 2**20:.1f} MiB, {growth(baseline) / 2**20:.1f} MiB without offload"
    )
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
    handle.disable()
    del model, handle
    assert backend.memory_allocated() == 0


@pytest.mark.fake_only  # the ranks run on the fake backend over gloo
def test_distributed_grad_mode_forwards_without_backward_stay_flat_on_two_ranks():
    mp.start_processes(_rank, args=(free_port(),), nprocs=2, join=True, start_method="spawn")
