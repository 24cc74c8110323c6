"""Pinned memory that runs out mid-enable degrades to pageable homes with a warning, and no
pinned allocation is larger than the backend's chunk."""

from __future__ import annotations

import logging

import pytest
import torch

import offload_core
from offload_core.hostmem import slabs as slabs_module

from slab_stacks import D, X, Stack  # blocks of one DxD float32 weight: 612.6 KiB

KIB, MIB = 2**10, 2**20
BLOCK = D * D * 4

pytestmark = pytest.mark.fake_only  # the fake's pinned cap and chunk


OPTIONS = {
    "layerwise": {"enable_layerwise_offload": True, "blocks": ["blocks"]},
    "model": {"enable_cpu_offload": True},
}


def fake(**options):
    return offload_core.get_backend("fake", chaos=True, chaos_delay=0.0005, **options)


def outputs(model) -> list[torch.Tensor]:
    """Two forwards, the second after the first has cycled every block."""
    with torch.no_grad():
        return [model(X + i) for i in range(2)]


def check_outputs(model, expected: list[torch.Tensor]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(outputs(model), expected, strict=True))


@pytest.mark.parametrize("strategy", ["layerwise", "model"])
def test_a_pinned_cap_below_the_budget_falls_back_to_pageable_homes_with_a_warning(strategy, caplog):
    model = Stack(blocks=12)
    expected = outputs(model)
    backend = fake(pinned_memory=MIB)  # the "driver" pins 1 MiB; the budget allows 1 GiB
    with caplog.at_level(logging.WARNING, logger="offload_core.hostmem.placement"):
        handle = offload_core.enable_offload(model, backend=backend, pinned_memory="1GiB", **OPTIONS[strategy])
    warnings = [r.getMessage() for r in caplog.records if "pinned memory ran out" in r.getMessage()]
    assert len(warnings) == 1
    stats = handle.stats()
    assert stats["pageable_host_bytes"] > 0 and stats["pinned_fallback_bytes"] == stats["pageable_host_bytes"]
    assert f"{stats['pinned_fallback_bytes'] / MIB:.1f} MiB of homes" in warnings[0]
    assert stats["pinned_host_bytes"] <= MIB
    if strategy == "layerwise":  # blocks of 0.6 MiB: the first one fits
        assert stats["pinned_host_bytes"] > 0
    check_outputs(model, expected)
    assert stats["pinned_host_bytes"] + stats["pageable_host_bytes"] >= stats["host_bytes"]
    assert handle.stats()["staged_bytes"] > 0  # the fallen-back homes came through the bounce ring
    handle.disable()
    check_outputs(model, expected)


def test_no_pinned_memory_at_all_gives_a_pageable_bounce_ring(caplog):
    model = Stack(blocks=4)
    expected = outputs(model)
    with caplog.at_level(logging.WARNING, logger="offload_core.hostmem.placement"):
        handle = offload_core.enable_offload(model, backend=fake(pinned_memory=0), **OPTIONS["layerwise"])
    assert "no pinned memory for the bounce ring" in caplog.text
    check_outputs(model, expected)
    stats = handle.stats()
    assert stats["pinned_host_bytes"] == 0 and stats["pageable_host_bytes"] == stats["host_bytes"]
    assert stats["blocking_copy_bytes"] > 0  # each copy from a pageable bounce buffer waited for
    handle.disable()


@pytest.mark.parametrize("rounding", ["exact", "pow2"])
def test_no_pinned_allocation_exceeds_the_backends_chunk(rounding, monkeypatch, caplog):
    chunk = 1280 * KIB  # two blocks; a slab would otherwise be at least 64 MiB
    backend = fake(pinned_chunk_bytes=chunk, pinned_rounding=rounding)
    sizes: list[int] = []
    empty_pinned = backend.empty_pinned

    def recorded(size, dtype=torch.uint8):
        tensor = empty_pinned(size, dtype)
        sizes.append(backend.pinned_allocation_size(tensor.nbytes))
        return tensor

    monkeypatch.setattr(backend, "empty_pinned", recorded)
    model = Stack(blocks=8)
    expected = outputs(model)
    with caplog.at_level(logging.WARNING):
        handle = offload_core.enable_offload(model, backend=backend, **OPTIONS["layerwise"])
    assert "pinned memory ran out" not in caplog.text  # nothing was refused: nothing asked above the chunk
    assert sizes and max(sizes) <= chunk and len(sizes) >= 5
    assert handle.stats()["pageable_host_bytes"] == 0
    check_outputs(model, expected)
    handle.disable()


def test_a_buffer_larger_than_the_chunk_is_pageable_from_the_plan(caplog):
    backend = fake(pinned_chunk_bytes=500 * KIB)  # below one block
    model = Stack(blocks=4)
    expected = outputs(model)
    with caplog.at_level(logging.WARNING, logger="offload_core.hostmem.placement"):
        handle = offload_core.enable_offload(model, backend=backend, **OPTIONS["layerwise"])
    assert "4 units) have a buffer larger than fake's largest pinned allocation (500.0 KiB)" in caplog.text
    stats = handle.stats()
    assert stats["pinned_fallback_bytes"] == 0  # planned pageable: nothing failed
    assert stats["pageable_host_bytes"] >= 4 * BLOCK
    check_outputs(model, expected)
    handle.disable()


def test_the_fake_refuses_a_single_allocation_above_its_chunk():
    backend = fake(pinned_chunk_bytes=MIB)
    backend.empty_pinned(MIB)
    with pytest.raises(torch.OutOfMemoryError, match="single allocation of 1048577 bytes is above the driver's limit"):
        backend.empty_pinned(MIB + 1)
    with pytest.raises(offload_core.OffloadConfigError, match="invalid pinned_chunk_bytes=0: must be > 0 bytes"):
        offload_core.get_backend("fake", pinned_chunk_bytes=0)


def test_slabs_refuse_a_buffer_above_the_chunk_rather_than_ask_for_it():
    backend = fake(pinned_chunk_bytes=MIB, pinned_rounding="pow2")
    allocator = slabs_module.SlabAllocator(backend, [600 * KIB] * 4)
    assert allocator.slab_bytes == MIB
    allocator.allocate(600 * KIB, torch.uint8)
    with pytest.raises(torch.OutOfMemoryError, match="larger than the largest pinned allocation of fake"):
        allocator.allocate(MIB + 1, torch.uint8)
