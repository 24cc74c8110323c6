"""``mem_get_info`` means memory available to new allocations: the fake can model a caching
allocator that keeps a reserve (``device_cache``), and the model-level prefetch rule decides on
the allocatable figure under that model, as it will on CUDA and NPU."""

from __future__ import annotations

import gc

import pytest
import torch
from torch import nn

import offload_core
from offload_core.common.transaction import Transaction
from offload_core.strategies.model_level import RESERVE_FRACTION, ModelLevelOffload

K = 64  # a KxK float32 Linear without bias: 16 KiB

# the fake's own options (pinned_rounding, device_cache, caps): simulator tests
pytestmark = pytest.mark.fake_only


def test_device_cache_keeps_freed_memory_reserved_and_counts_it_free(monkeypatch):
    backend = offload_core.get_backend("fake", chaos=False, device_memory=1000, device_cache=True)
    a = backend.empty_device(600)
    assert backend.mem_get_info() == (400, 1000)
    del a
    gc.collect()
    assert backend.memory_allocated() == 0 and backend.memory_reserved() == 600
    assert backend.mem_get_info() == (1000, 1000)  # the 600 idle bytes are free to new allocations
    b = backend.empty_device(900)  # fits: the reserve is reused, the rest comes from the "driver"
    assert backend.memory_reserved() == 900
    del b
    gc.collect()
    backend.empty_cache()
    assert backend.memory_reserved() == 0
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_DEVICE_CACHE", "1")
    assert offload_core.get_backend("fake", chaos=False).device_cache is True


def _two_groups(backend):
    torch.manual_seed(0)
    a, b = nn.Linear(K, K, bias=False), nn.Linear(K, K, bias=False)
    part = ModelLevelOffload([("a", [("a", a)]), ("b", [("b", b)])], backend)
    with Transaction() as txn:
        part.enable(txn)
    seen: list[str] = []  # b's state right after a became active: "loading" means prefetched
    a.register_forward_pre_hook(lambda *_: seen.append(part.groups[1].state))
    return part, a, b, seen


def test_model_level_prefetch_decides_on_allocatable_memory_under_a_caching_allocator():
    group = K * K * 4
    # Room for the active group and the next one beside it, less the activation reserve; the
    # allocator's cache after a call holds both groups, which a driver figure would count as used.
    capacity = 3 * group
    assert group <= capacity - group - RESERVE_FRACTION * capacity  # prefetch fits
    assert group > capacity - 2 * group - RESERVE_FRACTION * capacity  # but not in driver-free memory
    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001, device_memory=capacity, device_cache=True)
    part, a, b, seen = _two_groups(backend)
    x = torch.randn(2, K)
    with torch.no_grad():
        expected = b.weight.detach().clone(), a.weight.detach().clone()
        for _ in range(3):  # the first call fills the cache; the next ones run beside it
            y = b(a(x))
            part.release_all()
    assert backend.memory_reserved() >= 2 * group and backend.memory_allocated() == 0
    # not on the first call: what a's compute takes beside its weights is measured then
    assert seen == ["host", "loading", "loading"], "the next group was not prefetched beside the cache"
    assert torch.equal(y, x @ expected[1].T @ expected[0].T)
    assert backend.max_memory_allocated() <= capacity
    part.disable()
