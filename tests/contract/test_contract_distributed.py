"""Contract point 9 (docs/design.md) on two real gloo ranks, each run bounded in time (a hang
fails the test instead of blocking the suite): enable ends with an agreement (a rank that fails,
or holds different weights, rolls every rank back); a rank failing mid-forward makes the others
fail with a clear error and the next forward is exact on every rank; gathers that pair different
blocks raise instead of computing on mismatched weights; disable() after a failure restores the
exact weights, or says clearly it cannot and works once the ranks are in step again. Also the
distributed side of points 2, 4, 5 and 10: buffers updated in forward keep their values, block
tensors outside their forward never show another block's weights, structural changes, state
dicts and copies are refused with a clear error when a rank holds only shards."""

from __future__ import annotations

import copy
import datetime

import pytest
import torch

from two_ranks import four_blocks, join_ranks, run_step, spawn_bounded


def _alone(model, block: int):
    """A block called on its own, outside a model forward."""
    with torch.no_grad():
        return model.blocks[block](torch.randn(3, 8, generator=torch.Generator().manual_seed(7)))


def _sharded_contract(rank: int, port: int) -> None:
    backend = join_ranks(rank, port)
    import offload_core
    from contract_models import assert_same, raise_once
    from helpers import assert_same_state, snapshot

    DistributedOffloadError = offload_core.DistributedOffloadError

    def enable(model, backend=backend, **options):
        return offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend, **options)

    def untouched(model, before):
        assert_same_state(before, snapshot(model))
        assert all("forward" not in m.__dict__ for m in model.modules())

    # -- enable agreement: a rank that fails rolls every rank back --------------------------
    model = four_blocks()
    before = snapshot(model)
    # a device too small for the slots on rank 1 (a pinned cap no longer fails: homes fall back to pageable)
    failing = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001, device_memory=64 if rank == 1 else None)
    with pytest.raises(torch.OutOfMemoryError if rank == 1 else DistributedOffloadError, match="" if rank == 1 else "rank 1"):
        enable(model, backend=failing)
    untouched(model, before)

    # -- ranks holding different weights: every rank refuses --------------------------------
    if rank == 1:
        with torch.no_grad():
            model.blocks[2].layers[0].weight.add_(1e-3)
    before = snapshot(model)
    with pytest.raises(DistributedOffloadError, match="packed the model differently"):
        enable(model)
    untouched(model, before)

    # -- buffers updated in forward keep their values; placeholders outside a block's forward ----
    model, reference = four_blocks(counting=True), four_blocks(counting=True)
    handle = enable(model)
    for step in range(3):
        assert torch.equal(run_step(model, step), run_step(reference, step)), f"rank {rank} step {step}"
    outside = model.blocks[1].layers[0].weight
    assert outside.isnan().all(), "a sharded block's weights outside its forward are placeholders, never another block's"
    for write in (lambda: outside.data.add_(1), lambda: outside.mul_(2)):  # never silently dropped
        with pytest.raises(offload_core.OffloadedModelError, match=r"a shard on each rank.*handle\.disable\(\)"):
            write()
    with pytest.raises(offload_core.OffloadedModelError, match=r"collective handle\.disable\(\)"):
        model.half()
    for refused in (model.state_dict, lambda: model.blocks[0].load_state_dict(reference.blocks[0].state_dict()),
                    lambda: copy.deepcopy(model)):
        with pytest.raises(DistributedOffloadError, match=r"collective handle\.disable\(\)"):
            refused()
    handle.disable()
    assert_same(model, reference)

    # -- failures and mismatches: a clear error on every rank, then exact again ---------------
    model = four_blocks()
    before = snapshot(model)
    expected = [run_step(model, step) for step in range(8)]
    handle = enable(model)
    assert torch.equal(run_step(model, 0), expected[0])
    # a rank failing in the middle of a forward (the others' remaining loads are drained), then
    # one failing in the last block (only the end-of-forward header tells the others)
    for step, failing_rank, block in ((1, 0, 1), (2, 1, 3)):
        if rank == failing_rank:
            model.blocks[block].layers[0].register_forward_pre_hook(raise_once(RuntimeError("this rank fails")))
            with pytest.raises(RuntimeError, match="this rank fails"):
                run_step(model, step)
        else:
            with pytest.raises(DistributedOffloadError, match=f"rank {failing_rank} failed during this forward"):
                run_step(model, step)
        assert torch.equal(run_step(model, step), expected[step]), f"rank {rank}: the forward after a failure"
    # different blocks called alone on the two ranks: the gathers pair blocks 1 and 2
    with pytest.raises(DistributedOffloadError, match="out of step"):
        _alone(model, 1 + rank)
    assert torch.equal(run_step(model, 3), expected[3])
    # one rank runs an extra forward: it pairs with the other rank's next forward, block for block
    if rank == 0:
        assert torch.equal(run_step(model, 4), expected[4])
    for step in (5, 6):
        assert torch.equal(run_step(model, step), expected[step])
    if rank == 1:
        assert torch.equal(run_step(model, 7), expected[7])
    handle.disable()  # collective: the exact weights come back
    untouched(model, before)

    # -- disable without the other rank: it says it cannot, and changes nothing -----------------
    group = torch.distributed.new_group([0, 1], timeout=datetime.timedelta(seconds=5))
    alone = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    model = four_blocks()
    handle = enable(model, backend=alone, process_group=group)
    assert torch.equal(run_step(model, 0), expected[0])
    if rank == 0:
        with pytest.raises(DistributedOffloadError, match="cannot restore the exact weights"):
            handle.disable()
        assert handle.enabled and "forward" in model.__dict__
    torch.distributed.barrier()


def _replicated_contract(rank: int, port: int) -> None:
    backend = join_ranks(rank, port)
    import offload_core
    from contract_models import assert_same

    model, reference = four_blocks(counting=True), four_blocks(counting=True)
    handle = offload_core.enable_offload(
        model, enable_distributed_layerwise_offload=True, backend=backend, shard_host_weights=False
    )
    assert torch.equal(run_step(model, 0), run_step(reference, 0))
    new = {k: v + 0.5 if v.is_floating_point() else v for k, v in reference.state_dict().items()}
    for m in (model, reference):
        m.load_state_dict(new)
        with torch.no_grad():
            m.blocks[2].layers[0].weight.data.mul_(2)
    assert torch.equal(run_step(model, 1), run_step(reference, 1))
    assert_same(copy.deepcopy(model), reference)
    for m in (model, reference):  # a structural change: refused on every rank before the pass's collectives
        m.blocks[1].layers[0].weight.data = m.blocks[1].layers[0].weight.data.t()
    with pytest.raises(offload_core.DistributedOffloadError, match=r"collective handle\.disable\(\)"):
        run_step(model, 2)
    handle.disable()
    assert_same(model, reference)


def test_sharded_ranks_agree_fail_together_and_never_mix_blocks():
    spawn_bounded(_sharded_contract)


def test_replicated_ranks_take_writes_and_copies_like_layerwise():
    spawn_bounded(_replicated_contract)


def _disable_meets_forward(rank: int, port: int) -> None:
    """Issue 29 item 6: a rank's disable() meets only another rank's disable(). Paired with a
    forward (same blocks, same count of gathers) it fails on both ranks naming both operations;
    both ranks stay usable: the next forward is exact and a disable on both ranks restores."""
    backend = join_ranks(rank, port)
    import offload_core
    from helpers import assert_same_state, snapshot

    model = four_blocks()
    before = snapshot(model)
    expected = [run_step(model, step) for step in range(3)]
    handle = offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend)
    assert torch.equal(run_step(model, 0), expected[0])
    with pytest.raises(offload_core.DistributedOffloadError) as caught:
        handle.disable() if rank == 0 else run_step(model, 1)
    mine, theirs = ("handle.disable()", "a forward") if rank == 0 else ("a forward", "handle.disable()")
    assert f"this rank (rank {rank}) ran {mine} while rank {1 - rank} ran {theirs}" in str(caught.value)
    assert handle.enabled, f"rank {rank}: nothing changed"
    assert torch.equal(run_step(model, 2), expected[2]), f"rank {rank}: the forward after the mismatch"
    handle.disable()
    assert not handle.enabled
    assert_same_state(before, snapshot(model))


def test_a_ranks_disable_never_pairs_with_another_ranks_forward():
    spawn_bounded(_disable_meets_forward)


def _frozen_preloads(rank: int, port: int) -> None:
    """Issue 29 item 6 under ``handle.frozen()``: a pass's end there loads the next pass's first
    blocks early; those loads are the first of the rank's next operation, forward or disable. A
    disable paired with a forward still fails on both ranks (no hang: the same gathers on both),
    and ``frozen()`` on one rank only is exact, through forwards and disable."""
    import contextlib

    backend = join_ranks(rank, port)
    import offload_core
    from helpers import assert_same_state, snapshot

    model = four_blocks()
    before = snapshot(model)
    expected = [run_step(model, step) for step in range(4)]
    handle = offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend)
    with handle.frozen():
        assert torch.equal(run_step(model, 0), expected[0])
        with pytest.raises(offload_core.DistributedOffloadError) as caught:
            handle.disable() if rank == 0 else run_step(model, 1)
        mine, theirs = ("handle.disable()", "a forward") if rank == 0 else ("a forward", "handle.disable()")
        assert f"this rank (rank {rank}) ran {mine} while rank {1 - rank} ran {theirs}" in str(caught.value)
        assert handle.enabled, f"rank {rank}: nothing changed"
        assert torch.equal(run_step(model, 2), expected[2]), f"rank {rank}: the forward after the mismatch"
    only_rank_0 = handle.frozen() if rank == 0 else contextlib.nullcontext()
    with only_rank_0:
        assert torch.equal(run_step(model, 3), expected[3]), f"rank {rank}: frozen on rank 0 only"
    assert torch.equal(run_step(model, 1), expected[1]), f"rank {rank}: after frozen() on rank 0 only"
    with handle.frozen() if rank == 0 else contextlib.nullcontext():
        assert torch.equal(run_step(model, 2), expected[2])
        handle.disable()
    assert not handle.enabled
    assert_same_state(before, snapshot(model))


def test_frozen_preloads_keep_disable_and_forward_apart_on_every_rank():
    spawn_bounded(_frozen_preloads)
