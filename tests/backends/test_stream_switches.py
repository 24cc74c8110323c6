"""At most one stream context per block and per direction (``DeviceBackend.batch``): a block's
copies (one per dtype), its gathers and the blocks prefetched with it are queued under one stream
switch, on every strategy. Counted by the fake backend (``stream_switches``: the contexts an
accelerator would enter) and, for the accelerator base itself, by a stand-in device module that
counts the ``stream()`` contexts it is asked for. Outputs are exact throughout."""

from __future__ import annotations

import pytest
import torch

import offload_core

from helpers import free_port
from stacks import StackSpec, build_stack

pytestmark = pytest.mark.fake_only  # the fake's own counter

TWO_DTYPES = [[torch.float32, torch.bfloat16]] * 6
X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def _stack(d: int = 8):
    return build_stack(StackSpec(d=d, layer_dtypes=TWO_DTYPES, transposed=True, tie_within=True))


def _forward_switches(backend, handle, model, x, expected) -> tuple[int, int]:
    """(stream switches, block loads) of one forward, whose output must be exact."""
    switches, loads = backend.stream_switches, handle.stats()["loads"]
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    return backend.stream_switches - switches, handle.stats()["loads"] - loads


@pytest.mark.parametrize("depth", [1, 2])
def test_layerwise_one_switch_per_block_and_one_for_the_blocks_prefetched_together(new_backend, depth):
    backend = new_backend(chaos=False)
    model = _stack()
    with torch.no_grad():
        expected = model(X)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, prefetch_depth=depth, backend=backend)
    slots = handle.describe()[0]["slots"]
    assert slots == depth + 1
    for _ in range(2):  # the first forward is like every other
        switches, loads = _forward_switches(backend, handle, model, X, expected)
        assert loads == len(TWO_DTYPES) and handle.stats()["h2d_copies"] >= 2 * loads  # two dtypes a block
        # the first `slots` blocks are queued together at the start of the pass, one switch for all
        assert switches == loads - (slots - 1)
    handle.disable()


def test_staged_blocks_one_switch_per_block_through_the_bounce_ring(new_backend):
    """Homes without pinned memory go through the bounce ring on the stager thread: the ring's
    chunks of a block share the block's one stream context."""
    backend = new_backend(chaos=False)
    model = _stack(d=64)
    with torch.no_grad():
        expected = model(X.repeat(1, 8))
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend, pinned_memory=0)
    assert handle.stats()["pageable_host_bytes"] > 0
    for _ in range(2):
        switches, loads = _forward_switches(backend, handle, model, X.repeat(1, 8), expected)
        assert loads == len(TWO_DTYPES) and switches == loads
    handle.disable()


def test_model_level_one_switch_per_group_load(new_backend):
    backend = new_backend(chaos=False)
    model = _stack()
    with torch.no_grad():
        expected = model(X)
    handle = offload_core.enable_offload(model, enable_cpu_offload=True, backend=backend)
    for _ in range(2):
        copies = handle.stats()["h2d_copies"]
        switches, loads = _forward_switches(backend, handle, model, X, expected)
        assert loads == 1 and handle.stats()["h2d_copies"] - copies == 2  # one copy per dtype
        assert switches == 1
    handle.disable()


def test_the_fake_counts_each_unbatched_call_and_nothing_nested_on_the_same_stream(new_backend):
    """The counter itself: a copy outside a batch is a switch (the accelerator base selects its
    stream for it), inside a batch on its stream it is not; a batch on another stream is."""
    backend = new_backend(chaos=False)
    side, other = backend.new_stream(), backend.new_stream()
    src, dst, elsewhere = backend.empty_pinned(16), backend.empty_device(16), backend.empty_device(16)
    start = backend.stream_switches
    backend.copy_async(dst, src, side)
    backend.copy_async(dst, src, side)
    assert backend.stream_switches - start == 2
    with backend.batch(side):
        backend.copy_async(dst, src, side)
        backend.copy_async(dst, src)  # the current stream: side
        with backend.use_stream(side):
            backend.copy_async(dst, src, side)
        with backend.batch(other):
            backend.copy_async(elsewhere, src, other)
        backend.copy_async(elsewhere, src, other)  # named, not selected: a switch of its own
    assert backend.stream_switches - start == 2 + 1 + 1 + 1
    side.synchronize()
    other.synchronize()


# -- the accelerator base: the device module's stream contexts -------------------------------------


def test_accelerator_base_selects_the_stream_once_per_block(monkeypatch):
    """The generic accelerator backend against a stand-in device module (streams and events of
    its own, a synchronous device) that counts the ``stream()`` contexts it is asked for."""
    from vendor import VENDOR, VendorBackend, VendorModule

    entered: list = []
    stream = VendorModule.stream

    def counting(self, s):
        entered.append(s)
        return stream(self, s)

    monkeypatch.setattr(VendorModule, "stream", counting)
    monkeypatch.setattr("offload_core.device.accelerator._pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    VENDOR.__init__()
    backend = VendorBackend()
    model = _stack()
    with torch.no_grad():
        expected = model(X)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, prefetch_depth=1, backend=backend)
    for _ in range(2):
        entered.clear()
        before = backend.stream_switches
        loads = handle.stats()["loads"]
        with torch.no_grad():
            assert torch.equal(model(X), expected)
        loads = handle.stats()["loads"] - loads
        assert loads == len(TWO_DTYPES)
        assert len(entered) == backend.stream_switches - before == loads - 1  # two blocks queued together
    handle.disable()


# -- distributed: the gathers share the block's stream context ----------------------------------------


def _distributed_worker(rank: int, port: int) -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    torch.set_num_threads(1)
    import torch.distributed as dist

    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    backend.init_process_group(rank, 2, f"tcp://127.0.0.1:{port}")
    gathered_on: list = []
    gather = backend.all_gather_into_tensor

    def recording(output, input, group=None, stream=None):
        gathered_on.append(stream if stream is not None else backend.current_stream())
        return gather(output, input, group, stream)

    backend.all_gather_into_tensor = recording
    for pin_memory, shard in [(True, True), (False, True), (False, False)]:
        _distributed_case(backend, rank, pin_memory, shard, gathered_on)
    dist.destroy_process_group()


def _distributed_case(backend, rank: int, pin_memory: bool, shard: bool, gathered_on: list) -> None:
    from stacks import StackSpec, build_stack

    model = build_stack(StackSpec(d=32, layer_dtypes=TWO_DTYPES, transposed=True, tie_within=True, seed=3))
    x = torch.randn(2, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = [model(x + i) for i in range(3)]
    handle = offload_core.enable_offload(
        model, enable_distributed_layerwise_offload=True, backend=backend, shard_host_weights=shard,
        pin_memory=pin_memory, prefetch_depth=1,
    )
    part = handle.parts[0]
    case = f"rank {rank}, pin_memory={pin_memory}, shard_host_weights={shard}"
    if not pin_memory:
        assert handle.stats()["pinned_host_bytes"] == 0, case
    gathered_on.clear()
    for i in range(3):
        switches, loads = backend.stream_switches, handle.stats()["loads"]
        with torch.no_grad():
            assert torch.equal(model(x + i), expected[i]), f"{case}, step {i}"
        switches, loads = backend.stream_switches - switches, handle.stats()["loads"] - loads
        assert loads == len(TWO_DTYPES), case
        # a block's header, its shards' copies and their gathers: one switch per block; the first
        # two blocks queued together, pinned (pageable homes are loaded one by one by the stager);
        # the end of the pass gathers the end header and reads the headers back under one more
        together = 1 if pin_memory else 0
        end = 1 if shard else 0
        assert switches == loads - together + end, f"{case}: {switches} switches for {loads} loads"
    if shard:
        # every gather on the copy stream the process's distributed parts share, never on compute
        assert gathered_on and all(s is part.copy_stream for s in gathered_on), case
        assert part.copy_stream is not backend.current_stream()
    handle.disable()
    with torch.no_grad():
        assert torch.equal(model(x), expected[0]), case


def test_distributed_one_switch_per_block_with_its_gathers_pinned_or_not():
    """Two gloo ranks, sharded (pinned and pageable) and with whole pageable homes.
    ``pin_memory=False`` (what Ascend deployments use where pinned memory, async copies and
    concurrent collectives have deadlocked) is exact too, its gathers on the same dedicated copy
    stream, fenced from compute by each block's ready event."""
    import torch.multiprocessing as mp

    mp.spawn(_distributed_worker, args=(free_port(),), nprocs=2, join=True)
