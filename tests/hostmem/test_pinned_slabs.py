"""Pinned memory without waste: host homes are views into pinned slabs, the fake models torch's
power-of-two caching host allocator (``pinned_rounding="pow2"``), the handle reports the pinned
bytes really held, and ``disable`` gives them back slab by slab."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import offload_core
from offload_core.weights import WeightUnit, split_units
from offload_core.hostmem import slabs as slabs_module
from offload_core.hostmem.slabs import SlabAllocator, aligned
from offload_core.weights.owners import collect_tensors
from offload_core.weights.unit import ALIGN_BYTES

from slab_stacks import X, Stack, packed_units

MIB = 1 << 20

# the fake's own options (pinned_rounding, device_cache, caps): simulator tests
pytestmark = pytest.mark.fake_only


def pow2_backend(**options):
    return offload_core.get_backend("fake", chaos=True, chaos_delay=0.001, pinned_rounding="pow2", **options)


# -- the fake's model of the caching host allocator ----------------------------------------------


def test_pow2_rounding_rounds_each_request_and_caches_freed_blocks():
    backend = pow2_backend()
    assert backend.pinned_allocation_size(600_000) == MIB
    t = backend.empty_pinned(600_000)
    assert backend.pinned_memory_allocated() == MIB
    del t
    gc.collect()
    assert backend.pinned_memory_allocated() == MIB  # cached, not returned
    again = backend.empty_pinned(900_000)  # same block size: the cached block is reused
    assert backend.pinned_memory_allocated() == MIB
    del again
    gc.collect()
    backend.empty_host_cache()
    assert backend.pinned_memory_allocated() == 0


def test_pinned_rounding_from_the_environment_and_validated(monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_PINNED_ROUNDING", "pow2")
    backend = offload_core.get_backend("fake", chaos=False)
    assert backend.pinned_rounding == "pow2" and backend.pinned_allocation_size(3) == 4
    monkeypatch.delenv("OFFLOAD_CORE_FAKE_PINNED_ROUNDING")
    assert offload_core.get_backend("fake", chaos=False).pinned_allocation_size(3) == 3
    with pytest.raises(offload_core.OffloadConfigError, match="invalid pinned_rounding='round': choose from exact, pow2"):
        offload_core.get_backend("fake", pinned_rounding="round")


# -- waste: one pinned buffer per block against slabs --------------------------------------------


def test_slabs_hold_blocks_that_one_pinned_buffer_each_would_hold_at_two_fifths_waste():
    """The same units packed twice on a power-of-two host allocator: each block in a pinned buffer
    of its own (what packing did before slabs) holds 1 MiB for every 0.6 MiB block; packed through
    the slab allocator, the real pinned bytes stay within one slab of the packed bytes."""
    model = Stack(blocks=24)
    backend = pow2_backend()

    def units():
        resident, blocks = split_units(model, [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)])
        return (resident, *blocks)

    every = units()
    packed = sum(u.nbytes for u in every)
    for unit in every:
        unit.pack(backend.empty_pinned)
    assert backend.pinned_memory_allocated() / packed > 1.6
    for unit in every:
        unit.unpack()
    gc.collect()
    backend.empty_host_cache()
    assert backend.pinned_memory_allocated() == 0
    every = units()
    slabs = SlabAllocator(backend, [n * dtype.itemsize for u in every for dtype, n in u.numel.items()])
    for unit in every:
        unit.pack(slabs.allocate)
    real = backend.pinned_memory_allocated()
    assert real == slabs.live_bytes and slabs.live_slabs >= 1
    assert packed <= real < packed + max(s.capacity for s in slabs._slabs)
    for unit in every:
        unit.unpack()


@pytest.mark.parametrize("strategy", ["layerwise", "model"])
def test_slabs_keep_real_pinned_bytes_within_one_slab_of_the_packed_bytes(strategy):
    model = Stack(blocks=24)
    with torch.no_grad():
        expected = model(X)
    backend = pow2_backend()
    options = {"enable_layerwise_offload": True, "blocks": ["blocks"]} if strategy == "layerwise" else {"enable_cpu_offload": True}
    handle = offload_core.enable_offload(model, backend=backend, **options)
    with torch.no_grad():
        assert torch.equal(model(X), expected)
    stats = handle.stats()
    real = backend.pinned_memory_allocated()
    assert stats["pinned_host_bytes"] == real  # the backend's measurement, rounding included
    slabs = handle.placement.slabs
    largest_slab = max(s.capacity for s in slabs._slabs)
    packed = stats["host_bytes"]
    assert packed <= real <= packed + largest_slab
    assert real / packed < 1.15
    assert real == sum(aligned(b.numel() * b.element_size()) for u in packed_units(handle) for b in u.host.values()) + slabs.tail_bytes()
    handle.disable()
    assert backend.pinned_memory_allocated() == 0 and stats["pinned_host_bytes"] > handle.stats()["pinned_host_bytes"] == 0


def test_disable_returns_pinned_memory_slab_by_slab(monkeypatch):
    monkeypatch.setattr(slabs_module, "MIN_SLAB_BYTES", 2 * MIB)
    monkeypatch.setattr(slabs_module, "REQUESTS_PER_SLAB", 2)
    model = Stack(blocks=24)
    backend = pow2_backend()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    assert handle.placement.slabs.live_slabs >= 4
    held: list[int] = []
    unpack = WeightUnit.unpack

    def measure_and_unpack(self, *args):
        held.append(backend.pinned_memory_allocated())
        unpack(self, *args)

    monkeypatch.setattr(WeightUnit, "unpack", measure_and_unpack)
    handle.disable()
    # each slab goes back (cache emptied) as soon as its last unit is unpacked, not at the end
    assert held == sorted(held, reverse=True) and backend.pinned_memory_allocated() == 0
    assert len(set(held)) >= 4


# -- the allocator itself ------------------------------------------------------------------------


def test_views_are_aligned_disjoint_typed_and_live_as_long_as_the_slab():
    backend = offload_core.get_backend("fake", chaos=False, pinned_rounding="pow2")
    # aligned sizes 192, 192, 0, 320, 320 times ALIGN_BYTES / 64: none a power of two (those get
    # allocations of their own), together exactly one block of 16 alignments
    k = ALIGN_BYTES // 64
    requests = [(48 * k, torch.float32), (96 * k, torch.bfloat16), (0, torch.float16), (40 * k, torch.int64),
                (300 * k, torch.bool)]
    slabs = SlabAllocator(backend, [n * d.itemsize for n, d in requests])
    views = [slabs.allocate(n, d) for n, d in requests]
    for view, (n, dtype) in zip(views, requests):
        assert view.shape == (n,) and view.dtype == dtype and backend.is_pinned(view) == (n > 0)
        assert view.storage_offset() * dtype.itemsize % ALIGN_BYTES == 0
    for i, view in enumerate(views):
        view.fill_(i % 2 if view.dtype == torch.bool else i + 1)
    for i, view in enumerate(views):
        assert torch.equal(view, torch.full_like(view, i % 2 if view.dtype == torch.bool else i + 1)), "views overlap"
    assert slabs.live_slabs == 1 and backend.pinned_memory_allocated() == sum(aligned(n * d.itemsize) for n, d in requests)
    keep = views[1]
    del views, view
    gc.collect()
    assert slabs.live_slabs == 1  # one view still holds the slab
    del keep
    gc.collect()
    assert slabs.live_slabs == 0 and slabs.live_bytes == 0
    backend.empty_host_cache()  # the modelled caching allocator keeps freed blocks until emptied
    assert backend.pinned_memory_allocated() == 0


def test_requests_fill_slabs_in_order_so_that_they_free_in_order():
    """A request that does not fit opens the next slab; later, smaller requests do not go back to
    an earlier slab's tail, which would keep that slab alive until they are unpacked."""
    backend = offload_core.get_backend("fake", chaos=False, pinned_rounding="pow2")
    k = ALIGN_BYTES // 64  # sizes in units of 1/64 of the alignment
    slabs = SlabAllocator(backend, slab_bytes=1024 * k)
    first = slabs.allocate(640 * k, torch.uint8)  # a 1024k-byte slab, 384k-byte tail
    second = slabs.allocate(640 * k, torch.uint8)  # does not fit: a second slab
    small = slabs.allocate(64 * k, torch.uint8)  # would fit the first tail; goes to the newest slab
    assert small.untyped_storage().data_ptr() == second.untyped_storage().data_ptr()
    assert slabs.live_slabs == 2 and slabs.tail_bytes() == (384 + 320) * k
    del first
    gc.collect()
    assert slabs.live_slabs == 1  # the first slab went with its only buffer
    del second, small


def test_a_slab_over_a_pinned_cap_falls_back_to_the_request_alone():
    backend = offload_core.get_backend("fake", chaos=False, pinned_memory=4096, pinned_rounding="pow2")
    slabs = SlabAllocator(backend, [1024] * 8)  # plans one 8 KiB slab
    first = slabs.allocate(1024, torch.uint8)
    assert backend.pinned_memory_allocated() == 1024
    more = [slabs.allocate(1024, torch.uint8) for _ in range(3)]
    with pytest.raises(torch.OutOfMemoryError):
        slabs.allocate(1024, torch.uint8)
    del first, more


def test_host_homes_sharing_a_slab_keep_their_own_names_in_reports():
    from offload_core.common.labels import describe

    model = Stack(blocks=4)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=pow2_backend())
    part = handle.parts[0]
    homes = [(unit.name, buffer) for unit in part.units for buffer in unit.host.values()]
    assert len({buffer.untyped_storage().data_ptr() for _, buffer in homes}) < len(homes)  # slabs are shared
    for name, buffer in homes:
        assert describe(buffer[1:]) == f"host copy of {name}"
    handle.disable()


def test_units_packed_side_by_side_in_a_slab_view_their_own_bytes():
    """A home is a view at an offset into a slab: every tensor bound to it, at packing and after,
    sees its own values."""
    torch.manual_seed(0)
    layers = [nn.Linear(16, 32) for _ in range(3)]  # aligned homes of no power of two, filling one slab
    before = [(l.weight.detach().clone(), l.bias.detach().clone()) for l in layers]
    units = [WeightUnit(f"layer{i}", collect_tensors([l])) for i, l in enumerate(layers)]
    backend = offload_core.get_backend("fake", chaos=False, pinned_rounding="pow2")
    slabs = SlabAllocator(backend, [u.nbytes for u in units])
    for unit in units:
        unit.pack(slabs.allocate)
    assert slabs.live_slabs == 1 and units[1].host[torch.float32].storage_offset() > 0
    for unit, layer, (weight, bias) in zip(units, layers, before):
        assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias), unit.name  # bound at packing
        unit.bind(unit.views(unit.host))
        assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias), unit.name  # bound again
        unit.unpack()
        assert torch.equal(layer.weight, weight) and torch.equal(layer.bias, bias), unit.name


def test_a_backend_that_allocates_exact_sizes_gets_one_allocation_per_home():
    """Nothing to save by sharing, and each home's memory goes back the moment its unit is
    unpacked: disable holds no slab beyond the weights it has not given back yet."""
    backend = offload_core.get_backend("fake", chaos=False)
    slabs = SlabAllocator(backend, [640, 640, 64])
    views = [slabs.allocate(n, torch.uint8) for n in (640, 640, 64)]
    assert len({v.untyped_storage().data_ptr() for v in views}) == 3
    assert slabs.live_slabs == 3 and slabs.tail_bytes() == 0
    assert backend.pinned_memory_allocated() == aligned(640) + aligned(640) + aligned(64)
    del views[0]
    gc.collect()
    assert slabs.live_slabs == 2 and backend.pinned_memory_allocated() == aligned(640) + aligned(64)
