"""enable is a transaction, disable restores, misses are counted, and races are visible."""

from __future__ import annotations

import copy
import gc
import re
import weakref
import warnings

import pytest
import torch
from torch import nn

import offload_core
from offload_core.testing import SimulatorCapability
from offload_core.discovery import find_blocks
from offload_core.hostmem.slabs import SlabAllocator
from offload_core_fake import StreamRaceError

from helpers import assert_same_state, chaos_backend, device, run, snapshot
from stacks import StackSpec, build_stack

MIXED = [[torch.float32, torch.bfloat16], [torch.float16], [torch.float32, torch.float32], [torch.bfloat16], [torch.float32]]


def mixed_stack() -> nn.Module:
    return build_stack(StackSpec(d=8, layer_dtypes=MIXED, transposed=True, tie_within=True, tie_head=True))


def no_hooks(model: nn.Module) -> bool:
    return all(
        not m._forward_pre_hooks and not m._forward_hooks
        and not {"forward", "compile", "_compiled_call_impl"} & m.__dict__.keys()
        for m in model.modules()
    )


X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def test_disable_restores_values_dtypes_strides_sharing_and_identity():
    model = mixed_stack()
    model.blocks[1].layers[0].weight.requires_grad_(False)
    before = snapshot(model)
    expected = run(model, X)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    run(model, X)
    assert any(handle.backend.is_pinned(t.detach()) for t in model.parameters()), "enable offloaded nothing"
    handle.disable()
    assert_same_state(before, snapshot(model))
    assert no_hooks(model)
    assert torch.equal(run(model, X), expected)
    assert not any(handle.backend.is_pinned(t) for t in model.parameters())
    handle.disable()  # idempotent


def test_enabling_twice_is_a_clear_error_and_reenabling_after_disable_works():
    model = mixed_stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    with pytest.raises(offload_core.AlreadyEnabledError, match="already enabled"):
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    handle.disable()
    again = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    assert again.strategy == "layerwise"
    again.disable()


def _memory(backend) -> tuple[int, int]:
    gc.collect()
    return backend.memory_allocated(), backend.pinned_memory_allocated()


def _assert_untouched(model, before, backend, memory_before):
    assert_same_state(before, snapshot(model))
    assert no_hooks(model)
    assert not hasattr(model, "_offload_core_handle")
    device_bytes, pinned_bytes = _memory(backend)
    assert device_bytes == memory_before[0], "a slot or resident buffer leaked"
    assert pinned_bytes == memory_before[1], "a pinned buffer leaked"


@pytest.mark.requires_capability(SimulatorCapability.CAPACITY)
def test_device_oom_leaves_the_model_untouched():
    model = mixed_stack()
    before = snapshot(model)
    backend = chaos_backend(device_memory=256)
    memory = _memory(backend)
    with pytest.raises(torch.OutOfMemoryError):
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    _assert_untouched(model, before, backend, memory)


@pytest.mark.fake_only  # a pinned-memory cap
def test_device_oom_midway_through_enable_rolls_back():
    """A device one byte short of what enable takes: its last allocation fails, after the others
    succeeded, and the model is left as it was. (A pinned allocation that fails does not roll
    back: that home goes pageable, tests/hostmem/test_pinned_fallback.py.)"""
    model = mixed_stack()
    before = snapshot(model)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    needed = handle.stats()["device_peak_bytes"]
    handle.disable()
    backend = chaos_backend(device_memory=needed - 1)
    memory = _memory(backend)
    with pytest.raises(torch.OutOfMemoryError):
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    _assert_untouched(model, before, backend, memory)


@pytest.mark.parametrize("target", ["stack", "blockless"])
def test_first_copies_are_ordered_after_compute_on_reused_device_memory(target):
    """Device memory that compute touched and dropped, with no host sync since, may back the new
    slots and resident copies at once (a caching allocator reuses it): their first copies wait for
    that compute. A model without blocks is all resident (its copies are the first)."""
    model = mixed_stack() if target == "stack" else nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))
    expected = run(model, X)
    backend = chaos_backend()
    scratch = backend.empty_device(4096, torch.float32)
    scratch.fill_(1.0)  # compute on the default stream touches device memory ...
    del scratch  # ... which is dropped while that compute may still run
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    assert backend.memory_allocated() > 0, "enable put nothing on the device"
    assert torch.equal(run(model, X), expected)
    handle.disable()


def test_unknown_block_attribute_is_a_clear_error():
    model = mixed_stack()
    before = snapshot(model)
    backend = chaos_backend()
    memory = _memory(backend)
    with pytest.raises(offload_core.BlockDiscoveryError, match="nope.*children are: embed, blocks, head"):
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend, blocks=["nope"])
    _assert_untouched(model, before, backend, memory)


class Marked(torch.Tensor):
    """A tensor subclass with its own storage, as diffusers' GGUFParameter is."""


def test_storage_tensor_subclass_is_streamed_and_keeps_its_class():
    model = mixed_stack()
    layer = model.blocks[2].layers[0]
    layer.weight = nn.Parameter(layer.weight.detach().as_subclass(Marked))
    layer.weight.note = "kept"
    expected = run(model, X)
    before = snapshot(model)
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    home = handle.parts[0].units[2].host[layer.weight.dtype]  # what a block shows between forwards
    assert home.data_ptr() <= layer.weight.data_ptr() < home.data_ptr() + home.nbytes, "not packed into its home"
    assert type(layer.weight) is Marked and layer.weight.note == "kept"
    for _ in range(2):
        assert torch.equal(run(model, X), expected)
    handle.disable()
    assert type(layer.weight) is Marked and layer.weight.note == "kept"
    assert_same_state(before, snapshot(model))


def test_out_of_order_calls_load_synchronously_and_count_misses():
    model = mixed_stack()
    blocks = [b for _, b in find_blocks(model)]
    order = [4, 0, 2, 2, 1, 3]  # skips, repeats and runs backwards

    def run_in(model, blocks, order):
        with torch.no_grad():
            x = model.embed(X.to(device()))
            for i in order:
                x = blocks[i](x)
            return model.head(x).cpu()

    resident = copy.deepcopy(model).to(device())
    expected = run_in(resident, [b for _, b in find_blocks(resident)], order)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    assert torch.equal(run_in(model, blocks, order), expected)
    assert handle.stats()["prefetch_misses"] >= 3
    handle.disable()


@pytest.mark.requires_capability(SimulatorCapability.SANITIZE)
def test_removing_the_ready_wait_is_reported_as_a_race_naming_both_lines():
    """The sanitizer sees compute read a slot that the copy stream writes with no event between."""
    model = mixed_stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    handle.parts[0].wait_ready = lambda i: None
    with pytest.raises(StreamRaceError) as race:
        run(model, X)
    report = str(race.value)
    assert "read-after-write" in report
    assert re.search(r"this access: +read by aten\.\w+.* on stream 'default'", report)
    assert re.search(r"at tests/stacks\.py:\d+ in forward", report)  # the compute line
    assert re.search(r"earlier access: +write by copy_async \(H2D\)", report)
    assert re.search(r"at offload_core/strategies/transport\.py:\d+ in issue", report)  # the copy line
    handle.disable()


@pytest.mark.requires_capability(SimulatorCapability.CHAOS)
@pytest.mark.unsanitized("shows that chaos mode alone also sees this read-after-write race")
def test_removing_the_ready_wait_gives_wrong_output_under_chaos():
    """Proves the suite can see a race: the same run without the compute-waits-copy step fails."""
    model = mixed_stack()
    expected = run(model, X)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    part = handle.parts[0]
    assert torch.equal(run(model, X), expected)
    part.wait_ready = lambda i: None
    broken = run(model, X)
    assert not torch.equal(broken, expected)
    assert broken.isnan().any()
    handle.disable()


def _inside(storage_ptr: int, buffers) -> bool:
    return any(b.data_ptr() <= storage_ptr < b.data_ptr() + b.numel() * b.element_size() for b in buffers)


def test_block_tensors_show_their_slot_only_inside_their_own_forward():
    """Outside its forward a block shows its host buffer (the truth); inside, its device slot."""
    model = mixed_stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    part = handle.parts[0]
    seen = {}

    def probe(i):
        def hook(module, args):
            seen[i] = [p.data_ptr() for p in part.blocks[i].parameters()]
        return hook

    for i, block in enumerate(part.blocks):
        block.layers[0].register_forward_pre_hook(probe(i))
    run(model, X)
    slots = [buf for slot in part.slots for buf in slot.values()]
    for i, unit in enumerate(part.units):
        own = [p for p in part.blocks[i].parameters() if p is not model.head.weight]
        assert all(_inside(p.data_ptr(), unit.host.values()) for p in own), f"block {i} between forwards"
        assert all(_inside(ptr, slots) for ptr, p in zip(seen[i], part.blocks[i].parameters()) if p is not model.head.weight)
    handle.disable()


def test_a_forward_with_autograd_is_exact_and_silent():
    """Autograd through the blocks is supported (tests/training/test_autograd.py): nothing to warn about."""
    model = mixed_stack()
    expected = run(model, X)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = model(X)
    assert torch.equal(out.detach().cpu(), expected)
    handle.disable()


def test_no_device_allocation_per_forward():
    """Every forward streams its blocks (copies into the slots allocated at enable) and allocates
    nothing on the device."""
    model = mixed_stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    backend = handle.backend
    allocated = backend.memory_allocated()
    assert allocated > 0, "enable put nothing on the device"
    copies = []
    copy_async = backend.copy_async

    def refuse(*args, **kwargs):
        raise AssertionError("a forward allocated device memory")

    def counted(dst, src, *args, **kwargs):
        copies.append(src.nbytes)
        return copy_async(dst, src, *args, **kwargs)

    backend.empty_device = refuse
    backend.copy_async = counted
    for _ in range(3):
        run(model, X)
    assert backend.memory_allocated() == allocated
    assert len(copies) >= 3 * len(model.blocks), "the forwards did not stream their blocks"
    del backend.empty_device, backend.copy_async
    handle.disable()


def test_packing_releases_each_block_before_the_next_is_packed(monkeypatch):
    """Host memory during enable stays near one copy: a block's original tensors are freed as soon
    as it is packed, before the next block's pinned home is allocated."""
    model = build_stack(StackSpec(d=16, layer_dtypes=[[torch.float32]] * 5))
    freed: list[int] = []
    for index, block in enumerate(model.blocks):
        for p in block.parameters():
            weakref.finalize(p.untyped_storage(), freed.append, index)
    seen: list[int] = []
    allocate = SlabAllocator.allocate

    def tracking(self, *args, **kwargs):
        seen.append(len(set(freed)))
        return allocate(self, *args, **kwargs)

    monkeypatch.setattr(SlabAllocator, "allocate", tracking)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    # one pinned home for the resident part, then one per block: when block k is packed,
    # the originals of blocks 0..k-1 are already gone
    assert seen[1:] == list(range(len(model.blocks)))
    assert len(set(freed)) == len(model.blocks)
    handle.disable()


def test_a_declared_block_attribute_set_to_none_is_skipped():
    """Optional parts of a config (a UNet built without a mid block) are not an error."""
    model = mixed_stack()
    model.mid = None
    blocks = find_blocks(model, ["blocks", "mid"])
    assert [name for name, _ in blocks] == [f"blocks.{i}" for i in range(len(model.blocks))]


def test_state_dict_of_an_offloaded_model_holds_the_true_weights():
    model = mixed_stack()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    run(model, X)
    homes = [any(backend.is_pinned(p.detach()) for p in block.parameters()) for block in model.blocks]
    assert all(homes), "the blocks do not show their pinned homes: not offloaded"
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    handle.disable()


@pytest.mark.parametrize("strategy", ["enable_layerwise_offload", "enable_cpu_offload"])
def test_disable_frees_the_strategy_without_waiting_for_garbage_collection(strategy):
    """No reference cycle through the call wrappers: what a strategy still holds goes at disable."""
    model = mixed_stack()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **{strategy: True})
    run(model, X)
    part = weakref.ref(handle.parts[0])
    gc.disable()
    try:
        handle.disable()
        del handle
        assert part() is None, "the strategy outlives disable until the next garbage collection"
    finally:
        gc.enable()
