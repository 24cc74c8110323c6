"""Conformance: pinned host memory and device memory, with the accounting strategies report."""

from __future__ import annotations

import pytest
import torch

from offload_core import Capability
from offload_core.testing import SimulatorCapability
from offload_core.testing import kit

MIB = 1 << 20


def test_empty_pinned_is_pinned(backend):
    """Async copies need pinned host memory; ``is_pinned`` tells it from ordinary tensors."""
    p = backend.empty_pinned((4, 8), torch.float32)
    assert p.shape == (4, 8) and p.dtype == torch.float32 and p.device.type == "cpu"
    assert backend.is_pinned(p)
    assert backend.is_pinned(p[1:])  # a view of pinned memory is pinned
    flat = backend.empty_pinned(16)
    assert flat.shape == (16,) and flat.dtype == torch.uint8
    assert not backend.is_pinned(torch.empty(32))
    assert not backend.is_pinned(backend.empty_device(32))


def test_pinned_memory_is_accounted(backend):
    """``pinned_memory_allocated`` grows by what an allocation really takes
    (``pinned_allocation_size``: the host allocator's rounding), and the bytes go back when the
    tensor dies, once ``empty_host_cache`` has released what the allocator caches, where the
    backend can (``Capability.HOST_CACHE``); elsewhere the freed block stays counted, and is what
    the next request of its size reuses (``handle.stats()['pinned_host_bytes']`` is built on these)."""
    kit.collect()
    backend.empty_host_cache()
    before = backend.pinned_memory_allocated()
    empties = Capability.HOST_CACHE in backend.capabilities
    for nbytes in (MIB, 600 * 1024):  # a power of two, and 0.6 of one
        p = backend.empty_pinned(nbytes)
        real = backend.pinned_allocation_size(nbytes)
        assert nbytes <= real <= 2 * nbytes
        assert backend.pinned_memory_allocated() - before == real
        del p
        kit.collect()
        backend.empty_host_cache()
        assert backend.pinned_memory_allocated() - before == (0 if empties else real)


def test_empty_device_allocates_on_the_device(backend):
    t = backend.empty_device((3, 5), torch.bfloat16)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16
    assert t.device.type == backend.device_type
    assert not backend.is_pinned(t)


def test_device_memory_accounting_and_peak(backend):
    """``memory_allocated`` follows tensor lifetimes; the peak keeps the highest point until
    ``reset_peak_memory_stats`` (the strategies' ``device_peak_bytes`` is built on these)."""
    backend.synchronize()
    kit.collect()
    backend.reset_peak_memory_stats()
    before = backend.memory_allocated()
    assert backend.max_memory_allocated() == before

    a = backend.empty_device(MIB)
    assert MIB <= backend.memory_allocated() - before <= MIB + kit.ALLOC_SLACK
    b = backend.empty_device(2 * MIB)
    high = backend.memory_allocated()
    assert 3 * MIB <= high - before <= 3 * MIB + 2 * kit.ALLOC_SLACK
    del b
    kit.collect()
    assert MIB <= backend.memory_allocated() - before <= MIB + kit.ALLOC_SLACK
    assert backend.max_memory_allocated() == high  # the peak survives the free

    backend.reset_peak_memory_stats()
    assert backend.max_memory_allocated() == backend.memory_allocated()
    del a
    kit.collect()
    assert backend.memory_allocated() == before


def test_mem_get_info_is_sane(backend):
    free, total = backend.mem_get_info()
    assert isinstance(free, int) and isinstance(total, int)
    assert total > 0
    assert 0 <= free <= total


def test_mem_get_info_free_is_what_new_allocations_can_get(backend):
    """Free memory shrinks by an allocation and comes back when it is freed, even where a caching
    allocator keeps the freed block reserved: memory the backend's allocator holds idle is
    available to new allocations, so it is free (the model-level prefetch rule relies on it).
    A raw driver figure would stay low after the free."""
    size = 64 * MIB
    backend.synchronize()
    kit.collect()
    before = backend.mem_get_info()[0]
    t = backend.empty_device(size)
    during = backend.mem_get_info()[0]
    del t
    kit.collect()
    after = backend.mem_get_info()[0]
    tolerance = 4 * MIB  # drivers report free memory in pages of up to 2 MiB
    assert before - during >= size - tolerance
    assert abs(after - before) <= tolerance


def test_capacity_raises_out_of_memory(backend, new_backend):
    """With ``device_memory`` set, an allocation past it raises ``torch.OutOfMemoryError`` (what
    callers catch on real devices), accounts nothing, and fits again once memory is freed."""
    if SimulatorCapability.CAPACITY not in type(backend).capabilities:
        pytest.skip(f"backend {backend.name!r} has no {SimulatorCapability.CAPACITY!r} capability")
    capacity = 4 * MIB
    b = new_backend(device_memory=capacity)
    assert b.mem_get_info()[1] == capacity
    first = b.empty_device(3 * MIB)
    free, total = b.mem_get_info()
    assert total == capacity and free <= capacity - 3 * MIB
    with pytest.raises(torch.OutOfMemoryError):
        b.empty_device(2 * MIB)
    assert b.memory_allocated() == 3 * MIB
    del first
    kit.collect()
    second = b.empty_device(4 * MIB)
    assert b.memory_allocated() == 4 * MIB and second.numel() == 4 * MIB
