"""Registered pinned memory (``Capability.HOST_REGISTER``): homes and the bounce ring in page-aligned
memory registered with the runtime in chunks, pinned bytes exactly the packed bytes plus their
alignment, everything unregistered by ``disable``; on the fake (``pinned_rounding="register"``),
and the CUDA and NPU paths against stand-ins of their runtime calls."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import offload_core
from offload_core import Capability
from offload_core.hostmem.registered import PAGE_BYTES, RegisteredMemory, page_round
from offload_core.hostmem.slabs import aligned
from offload_core_cuda import CudaBackend
from offload_core_npu import ACL_HOST_REG_PINNED

from slab_stacks import X, Stack, packed_units  # blocks of one float32 weight of 612.6 KiB
from vendor import NPU_ONLY, VENDOR, StandInModule, VendorBackend

KIB, MIB = 2**10, 2**20

OPTIONS = {
    "layerwise": {"enable_layerwise_offload": True, "blocks": ["blocks"]},
    "model": {"enable_cpu_offload": True},
}


def outputs(model) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(X + i) for i in range(2)]


def recording(backend, monkeypatch) -> list[tuple[str, int, int]]:
    """Every register_host / unregister_host call of ``backend``: (name, ptr, bytes)."""
    calls: list[tuple[str, int, int]] = []
    register, unregister = backend.register_host, backend.unregister_host

    def registered(ptr, nbytes):
        register(ptr, nbytes)
        calls.append(("register", ptr, nbytes))

    def unregistered(ptr):
        unregister(ptr)
        calls.append(("unregister", ptr, 0))

    monkeypatch.setattr(backend, "register_host", registered)
    monkeypatch.setattr(backend, "unregister_host", unregistered)
    return calls


def home_buffers(handle) -> list[torch.Tensor]:
    return [b for u in packed_units(handle) for b in u.host.values()]


# -- the fake's model --------------------------------------------------------------------------


@pytest.mark.fake_only
@pytest.mark.parametrize("strategy", ["layerwise", "model"])
def test_registered_homes_pin_exactly_the_packed_bytes_in_chunks_and_disable_unregisters(strategy, monkeypatch):
    model = Stack(blocks=6)
    expected = outputs(model)
    chunk = 256 * KIB  # below one block: each slab is registered in several pieces
    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.0005, pinned_rounding="register",
                                       pinned_chunk_bytes=chunk)
    assert Capability.HOST_REGISTER in backend.capabilities
    calls = recording(backend, monkeypatch)
    handle = offload_core.enable_offload(model, backend=backend, **OPTIONS[strategy])
    assert all(a.equal(b) for a, b in zip(outputs(model), expected, strict=True))
    homes = home_buffers(handle)
    assert homes and all(backend.is_pinned(b) for b in homes)
    stats = handle.stats()
    packed = sum(aligned(b.nbytes) for b in homes)
    # one registered slab here (less than the smallest slab to pack): the packed bytes, each buffer
    # at an aligned offset, rounded up to a whole page; a power-of-two allocator would pin 4 MiB
    assert stats["pinned_host_bytes"] == backend.pinned_memory_allocated() == page_round(packed)
    assert stats["pageable_host_bytes"] == 0
    registered = [n for name, _, n in calls if name == "register"]
    assert len(registered) > 1 and max(registered) <= chunk and sum(registered) == page_round(packed)
    assert all(ptr % PAGE_BYTES == 0 for _, ptr, _ in calls)
    held = homes[0]  # a view the caller still holds past disable
    values = held.clone()
    handle.disable()
    assert backend.pinned_memory_allocated() == 0
    assert sorted(p for name, p, _ in calls if name == "unregister") == sorted(p for name, p, _ in calls if name == "register")
    assert not backend.is_pinned(held) and torch.equal(held, values)  # still valid memory, pageable now
    assert all(a.equal(b) for a, b in zip(outputs(model), expected, strict=True))


@pytest.mark.fake_only
def test_a_refused_registration_falls_back_to_pageable_homes(caplog):
    model = Stack(blocks=6)
    expected = outputs(model)
    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.0005, pinned_rounding="register",
                                       pinned_memory=1500 * KIB)
    with caplog.at_level(logging.WARNING, logger="offload_core.hostmem.placement"):
        handle = offload_core.enable_offload(model, backend=backend, pinned_memory="1GiB", **OPTIONS["layerwise"])
    assert "pinned memory ran out" in caplog.text and "tried to pin" in caplog.text
    assert all(a.equal(b) for a, b in zip(outputs(model), expected, strict=True))
    stats = handle.stats()
    assert stats["pinned_fallback_bytes"] > 0 and 0 < backend.pinned_memory_allocated() <= 1500 * KIB
    handle.disable()
    assert backend.pinned_memory_allocated() == 0


@pytest.mark.fake_only
def test_the_fake_refuses_what_a_runtime_refuses():
    backend = offload_core.get_backend("fake", pinned_rounding="register", pinned_chunk_bytes=2 * PAGE_BYTES)
    memory = RegisteredMemory(backend)
    block = memory.allocate(PAGE_BYTES + 1)
    assert block.nbytes == 2 * PAGE_BYTES and backend.pinned_memory_allocated() == 2 * PAGE_BYTES
    with pytest.raises(ValueError, match="already registered"):
        backend.register_host(block.data_ptr(), PAGE_BYTES)
    with pytest.raises(ValueError, match="page-aligned"):
        backend.register_host(block.data_ptr() + 64, PAGE_BYTES)
    with pytest.raises(torch.OutOfMemoryError, match="single registration"):
        backend.register_host(block.data_ptr() + 2 * PAGE_BYTES, 3 * PAGE_BYTES)
    del block
    gc.collect()
    assert backend.pinned_memory_allocated() == 0 and memory.live_blocks == 0
    plain = offload_core.get_backend("fake")
    assert Capability.HOST_REGISTER not in plain.capabilities
    with pytest.raises(NotImplementedError, match="cannot register host memory"):
        plain.register_host(0, PAGE_BYTES)


# -- CUDA: torch.cuda.cudart()'s calls, stood in --------------------------------------------------

#: the names torch binds in ``torch.cuda.cudart()`` that the CUDA backend calls (torch's
#: csrc/cuda/shared/cudart.cpp: ``cudaHostRegister(ptr, size, flags)``, ``cudaHostUnregister(ptr)``,
#: ``cudaGetErrorString``, the enum ``cudaError`` with ``success``); a CPU build has no cudart
CUDART_NAMES = {"cudaHostRegister", "cudaHostUnregister", "cudaGetErrorString", "cudaError"}


class StandInCudart:
    """``torch.cuda.cudart()``: records calls, fails with an error code when told to."""

    class cudaError:  # noqa: N801 - the real name
        success = 0

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.fail = 0

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("cudaHostRegister", ptr, size, flags))
        return self.fail

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("cudaHostUnregister", ptr))
        return 0

    def cudaGetErrorString(self, error: int) -> str:  # noqa: N802
        return {2: "out of memory"}.get(error, "unknown error")


class CudaModule(StandInModule):
    def __init__(self) -> None:
        super().__init__()
        self.runtime = StandInCudart()

    def cudart(self):
        return self.runtime


class RegisteringCuda(CudaBackend):
    @classmethod
    def probe(cls) -> bool:
        return True

    def _device_module(self):
        return CudaModule()


def test_the_stand_ins_carry_only_the_real_modules_names():
    assert hasattr(torch.cuda, "cudart")  # in every torch build
    names = {n for n in dir(StandInCudart) if not n.startswith("_")} - {"calls", "fail"}
    assert names == CUDART_NAMES
    assert "npurt" in NPU_ONLY_REGISTRATION and NPU_ONLY_REGISTRATION - NPU_ONLY == {"npurt"}


def test_cuda_registers_through_cudart_exactly_and_counts_the_bytes():
    backend = RegisteringCuda()
    runtime = backend._mod.runtime
    assert Capability.HOST_REGISTER in backend.capabilities
    memory = RegisteredMemory(backend)
    block = memory.allocate(3 * PAGE_BYTES)
    ptr = block.data_ptr()
    assert runtime.calls == [("cudaHostRegister", ptr, 3 * PAGE_BYTES, 0)]  # no rounding
    assert backend.pinned_memory_allocated() == 3 * PAGE_BYTES and backend.is_pinned(block[PAGE_BYTES:])
    with pytest.raises(ValueError, match="page-aligned"):
        backend.register_host(ptr + 8, PAGE_BYTES)
    runtime.fail = 2
    with pytest.raises(torch.OutOfMemoryError, match=f"cudaHostRegister of {PAGE_BYTES} bytes failed: out of memory"):
        memory.allocate(PAGE_BYTES)
    assert backend.pinned_memory_allocated() == 3 * PAGE_BYTES  # the refused one is not counted
    memory.close()
    assert runtime.calls[-1] == ("cudaHostUnregister", ptr) and backend.pinned_memory_allocated() == 0
    assert not backend.is_pinned(block)


# -- NPU: torch_npu's npurt(), stood in, end to end on a CPU-hosted stand-in device -------------------

#: torch_npu's names beyond torch.cuda's that the NPU backend uses for registration
#: (``torch_npu.npu.npurt()``: ``npuHostRegister(ptr, size, flags)``, ``npuHostUnregister(ptr)``)
NPU_ONLY_REGISTRATION = NPU_ONLY | {"npurt"}


class StandInNpurt:
    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.live: set[int] = set()

    def npuHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("npuHostRegister", ptr, size, flags))
        self.live.add(ptr)
        return 0

    def npuHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("npuHostUnregister", ptr))
        if ptr not in self.live:
            return 107000  # ACL_ERROR_RT_PARAM_INVALID
        self.live.remove(ptr)
        return 0


def test_npu_registers_homes_through_npurt_and_disable_unregisters_them(vendor_backend, monkeypatch):
    model = Stack(blocks=6)
    expected = outputs(model)
    runtime = StandInNpurt()
    assert Capability.HOST_REGISTER not in vendor_backend.capabilities  # a torch_npu without npurt
    monkeypatch.setattr(VENDOR, "npurt", lambda: runtime, raising=False)
    backend = VendorBackend()
    assert Capability.HOST_REGISTER in backend.capabilities
    for options in OPTIONS.values():
        handle = offload_core.enable_offload(model, backend=backend, **options)
        assert all(a.equal(b) for a, b in zip(outputs(model), expected, strict=True))
        homes = home_buffers(handle)
        assert backend.pinned_memory_allocated() == page_round(sum(aligned(b.nbytes) for b in homes))
        assert runtime.live and all(flags == ACL_HOST_REG_PINNED for _, _, _, flags in
                                    (c for c in runtime.calls if c[0] == "npuHostRegister"))
        handle.disable()
        assert runtime.live == set() and backend.pinned_memory_allocated() == 0
        assert all(a.equal(b) for a, b in zip(outputs(model), expected, strict=True))
