"""Distributed layerwise offload across 2 real processes (gloo): exact output, a fixed two-block
device buffer, 1/N of the block weights on each rank's host (as the backend measures its pinned
memory), the timeline of a sharded forward, and a collective disable."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from offload_core.weights.unit import ALIGN_BYTES

from helpers import free_port

WORLD = 2
D = 32  # wide enough that half the blocks' bytes dwarf alignment and padding

# the ranks run on the fake backend over gloo; a device backend's collectives need one device per rank
pytestmark = pytest.mark.fake_only


def _worker(rank: int, port: int, shard: bool, pipeline: bool) -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/ helpers in the spawned process
    torch.set_num_threads(1)
    import offload_core
    from helpers import assert_same_state, snapshot
    from stacks import StackSpec, build_stack

    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    backend.init_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}")
    if pipeline:
        _every_supported_row(backend)
        return
    dtypes = [[torch.float32, torch.bfloat16], [torch.float16], [torch.float32], [torch.bfloat16, torch.float32], [torch.float32]]
    model = build_stack(StackSpec(d=D, layer_dtypes=dtypes, transposed=True, tie_within=True, tie_head=True, seed=3))
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = [model(x + i) for i in range(3)]
    before = snapshot(model)
    import torch.distributed as dist

    with pytest.raises(offload_core.OffloadConfigError, match="process_group= applies to distributed layerwise"):
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend, process_group=dist.group.WORLD)
    model_bytes, block_bytes, tensors = _measured_bytes(model)
    pinned_before = backend.pinned_memory_allocated()
    with pytest.warns(UserWarning, match="ignoring enable_layerwise_offload"):
        handle = offload_core.enable_offload(
            model, enable_distributed_layerwise_offload=True, enable_layerwise_offload=True,
            backend=backend, shard_host_weights=shard, prefetch_depth=3,
        )
    pinned = backend.pinned_memory_allocated() - pinned_before  # what the backend really pinned
    part = handle.parts[0]
    assert handle.strategy == "distributed" and part.num_slots == 2
    with torch.no_grad():
        for i in range(3):
            assert torch.equal(model(x + i), expected[i]), f"rank {rank} step {i}"
    with handle.trace() as timeline, torch.no_grad():
        assert torch.equal(model(x), expected[0])
    spans = timeline.spans()
    assert [s.name for s in spans if s.kind == "compute"] == [f"Stack.blocks.{i}" for i in range(len(dtypes))]
    loads = [s for s in spans if s.kind == "copy"]  # a shard's copy and its all-gather, per block
    assert loads and all(s.lane == "copy" and s.name.startswith("load Stack.blocks.") for s in loads)
    stats = handle.stats()
    assert stats["prefetch_misses"] == 0
    assert stats["device_peak_bytes"] == part.device_weight_bytes
    for n in part.slot_shape.values():
        assert n % WORLD == 0
    # the shards and the resident part are pinned homes, reported from the backend's allocations
    assert stats["pinned_host_bytes"] == pinned > 0
    # slack: a 64-byte alignment per tensor, and padding each block's buffers to a multiple of N
    slack = ALIGN_BYTES * tensors + WORLD * 8 * len(dtypes) * 2
    resident_bytes = model_bytes - block_bytes
    if shard:
        with pytest.raises(RuntimeError, match="collective handle.disable"):
            model.state_dict()  # a rank holds half of each block: no state dict without a gather
        # each rank's host holds the resident part and 1/N of every block, measured by the backend
        assert resident_bytes + block_bytes / WORLD <= pinned <= resident_bytes + block_bytes / WORLD + slack
        assert pinned < model_bytes - block_bytes / (2 * WORLD)
    else:
        assert model_bytes <= pinned <= model_bytes + slack
        for key, value in model.state_dict().items():
            assert torch.equal(value, before["tensors"][key][1]), key
    handle.disable()
    assert backend.pinned_memory_allocated() == pinned_before
    assert_same_state(before, snapshot(model))
    with torch.no_grad():
        assert torch.equal(model(x), expected[0])


def _measured_bytes(model) -> tuple[int, int, int]:
    """(bytes of every distinct storage, bytes of those held by one block alone, tensors), read
    from the model before offloading, independently of how the strategy splits it."""
    inside = {id(m): i for i, block in enumerate(model.blocks) for m in block.modules()}
    place: dict[int, set[int]] = {}
    nbytes: dict[int, int] = {}
    tensors = 0
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None:
                key = t.untyped_storage().data_ptr()
                place.setdefault(key, set()).add(inside.get(id(module), -1))
                nbytes[key] = t.untyped_storage().nbytes()
                tensors += 1
    blocks = sum(nbytes[k] for k, p in place.items() if len(p) == 1 and -1 not in p)
    return sum(nbytes.values()), blocks, tensors


def _every_supported_row(backend) -> None:
    """Each row of the supported-model table, sharded over the ranks: pipelines end to end, and
    the DiTs and stand-ins alone."""
    import offload_core
    from helpers import forward
    from denoisers import TRANSFORMERS, build_transformer
    from offload_core.tiny import build_pipeline
    from standins import build_standin
    from tools.supported_models import ROWS

    for row in ROWS:
        if row.tiny_pipeline:
            tiny = build_pipeline(row.tiny_pipeline)
            expected = tiny.run(seed=0)
            handle = offload_core.enable_offload(tiny.pipe, enable_distributed_layerwise_offload=True, backend=backend)
            for _ in range(2):
                assert torch.equal(tiny.run(seed=0), expected), row.pipeline
            handle.disable()
            assert torch.equal(tiny.run(seed=0), expected), row.pipeline
        for name in row.tiny_models:
            model, inputs = build_transformer(name) if name in TRANSFORMERS else build_standin(name)
            expected = forward(model.eval(), inputs)
            handle = offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend)
            for _ in range(2):
                assert torch.equal(forward(model, inputs), expected), name
            assert handle.stats()["prefetch_misses"] == 0
            handle.disable()


@pytest.mark.parametrize("shard", [True, False], ids=["sharded", "replicated"])
def test_distributed_layerwise_on_two_ranks(shard):
    mp.spawn(_worker, args=(free_port(), shard, False), nprocs=WORLD, join=True)


def test_distributed_layerwise_on_every_supported_row():
    mp.spawn(_worker, args=(free_port(), True, True), nprocs=WORLD, join=True)


def test_distributed_needs_a_process_group():
    import offload_core
    from stacks import StackSpec, build_stack

    model = build_stack(StackSpec())
    with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
        offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend="fake")
    assert all(not m._forward_pre_hooks for m in model.modules())
