"""Partial residency (docs/layerwise.md): blocks kept on the device stay there for the whole run,
the others stream through the slot ring. Outputs and gradients equal the resident model's; each
forward copies exactly the streamed blocks' bytes; device memory is the resident weights (kept
blocks included) plus the slots; a kept block reached first starts the pass's loads."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

import offload_core
from offload_core.discovery import find_blocks

from denoisers import build_transformer
from helpers import chaos_backend, device, exact_accounting, first_tensor, forward, run

MODELS = ["flux2", "wan-t2v", "qwen-image"]


def _streamed_bytes(part) -> int:
    return sum(unit.nbytes for unit in part.units)


@pytest.mark.parametrize("share", [0.25, 0.5, 0.99])
@pytest.mark.parametrize("name", MODELS)
def test_kept_blocks_stay_and_only_streamed_blocks_are_copied(name, share):
    model, inputs = build_transformer(name)
    model.eval()
    n = len(find_blocks(model))
    keep = max(1, min(n - 1, round(share * n)))
    expected = [forward(model, {**inputs}) for _ in range(2)]
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         resident_blocks=keep)
    part = handle.parts[0]
    assert len(part.kept) == keep and len(part.units) == n - keep
    for block in part.kept:  # kept blocks are resident weights: on the device outside any forward
        assert all(p.device == device() for p in block.parameters())
    before = handle.stats()
    for step in range(2):
        assert torch.equal(forward(model, inputs), expected[step]), f"step {step} differs"
    stats = handle.stats()
    assert stats["h2d_bytes"] - before["h2d_bytes"] == 2 * _streamed_bytes(part)
    assert stats["loads"] - before["loads"] == 2 * len(part.units)
    assert stats["prefetch_misses"] == 0
    if exact_accounting():
        assert stats["device_peak_bytes"] == part.resident_bytes + part.num_slots * part.slot_bytes
    handle.disable()
    assert torch.equal(forward(model, inputs), expected[0])


def test_more_kept_blocks_copy_fewer_bytes():
    model, inputs = build_transformer("wan-t2v")
    n = len(find_blocks(model))
    copied = []
    for keep in range(n):
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                             resident_blocks=keep)
        before = handle.stats()["h2d_bytes"]
        forward(model, inputs)
        copied.append(handle.stats()["h2d_bytes"] - before)
        handle.disable()
    assert copied == sorted(copied, reverse=True) and len(set(copied)) == n, copied


def test_a_kept_first_block_starts_the_loads_of_the_pass():
    """The first streamed block's copy is queued when the kept block before it starts, so that
    it copies while the kept block computes."""
    model, inputs = build_transformer("wan-t2v")
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         resident_blocks=1)
    part = handle.parts[0]
    first = model.get_submodule(part.kept_names[0])
    assert part.kept_names[0] == part.all_names[0], "the spacing keeps the first block"
    seen = []
    child = next(m for m in first.modules() if m is not first and isinstance(m, torch.nn.Linear))
    child.register_forward_pre_hook(lambda module, args: seen.append(part.ring.occupants))
    forward(model, inputs)
    assert seen and seen[0][0] == 0, f"slots while the kept block ran: {seen[0] if seen else None}"
    handle.disable()


@pytest.mark.parametrize("name", ["flux2", "qwen-image"])
def test_gradients_through_kept_and_streamed_blocks(name):
    model, inputs = build_transformer(name)
    reference = copy.deepcopy(model)
    model.requires_grad_(True)
    reference.requires_grad_(True)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         resident_blocks=len(find_blocks(model)) // 2)
    for m in (model, reference):
        first_tensor(m(**inputs)).float().square().mean().backward()
    grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    got = {n: p.grad.to(grads[n].device) for n, p in model.named_parameters() if p.grad is not None}
    assert grads and grads.keys() == got.keys()
    wrong = [n for n in grads if not torch.equal(got[n], grads[n])]
    assert not wrong, wrong[:5]
    handle.disable()


def test_kept_blocks_queue_the_streamed_blocks_after_them_as_far_as_the_ring_allows():
    """While a kept block runs, the streamed blocks after it are copied as far as the slots allow:
    a kept block's compute is what hides their copies."""
    from stacks import StackSpec, build_stack

    model = build_stack(StackSpec(layer_dtypes=[[torch.float32]] * 8))
    x = torch.randn(4, 8)
    expected = run(model, x)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         resident_blocks=4)
    part = handle.parts[0]
    streamed_before = 0
    seen = {}
    for name in part.all_names:
        if name in part.kept_names and 0 < streamed_before < len(part.units) - 1:
            ahead = streamed_before + 1  # the second streamed block after this kept one
            model.get_submodule(name).layers[0].register_forward_pre_hook(functools.partial(_note, seen, part, ahead))
        streamed_before += name not in part.kept_names
    run(model, x)
    assert seen, "no kept block sits between streamed ones"
    for ahead, occupants in seen.items():
        assert occupants[ahead % part.num_slots] == ahead, f"block {ahead} was not queued: {occupants}"
    assert torch.equal(run(model, x), expected)
    handle.disable()


def _note(seen: dict, part, ahead: int, module, args) -> None:
    seen.setdefault(ahead, part.ring.occupants)


def _distributed_worker(rank: int, port: int) -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    torch.set_num_threads(1)
    from stacks import StackSpec, build_stack

    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    backend.init_process_group(rank, 2, f"tcp://127.0.0.1:{port}")
    model = build_stack(StackSpec(d=16, layer_dtypes=[[torch.float32]] * 6, seed=1))
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x)
    handle = offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend,
                                         resident_blocks=3)
    part = handle.parts[0]
    assert len(part.kept) == 3 and len(part.units) == 3 and part.home_policy.sharded
    for step in range(2):
        before = handle.stats()["loads"]
        with torch.no_grad():
            assert torch.equal(model(x), expected), f"rank {rank} step {step}"
        assert handle.stats()["loads"] - before == 3, "only the streamed blocks are gathered"
    handle.disable()
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    # no strategy flag: a budget with a process group streams across the ranks
    import torch.distributed as dist

    model = build_stack(StackSpec(d=32, layer_dtypes=[[torch.float32]] * 8, seed=2))
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x)
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    handle = offload_core.enable_offload(model, backend=backend, device_memory=int(0.7 * weights),
                                         activation_memory=2**10, process_group=dist.group.WORLD)
    assert handle.strategy == "distributed" and handle.plan.chosen_by == "budget", str(handle.plan)
    assert handle.parts[0].kept and handle.parts[0].home_policy.sharded
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    handle.disable()


@pytest.mark.fake_only("ranks over gloo on the fake backend")
def test_distributed_ranks_keep_the_same_blocks_and_gather_the_others():
    import torch.multiprocessing as mp

    from helpers import free_port

    mp.spawn(_distributed_worker, args=(free_port(),), nprocs=2)
