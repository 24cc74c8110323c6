"""Conformance: host registration (``Capability.HOST_REGISTER``), where the backend has it. Memory
registered the way offload-core registers homes and the bounce ring pins exactly the pages asked
for, is pinned for ``is_pinned`` and ``copy_async``, round-trips through the device bit for bit,
and gives its bytes back when unregistered."""

from __future__ import annotations

import pytest
import torch

from offload_core import Capability
from offload_core.hostmem.registered import PAGE_BYTES, RegisteredMemory, page_round
from offload_core.testing import kit


def test_registered_memory_is_pinned_exactly_copies_and_is_given_back(backend):
    if Capability.HOST_REGISTER not in backend.capabilities:  # per instance: the NPU runtime may lack it
        pytest.skip(f"backend {backend.name!r} does not register host memory")
    kit.collect()
    before = backend.pinned_memory_allocated()
    memory = RegisteredMemory(backend)
    nbytes = 3 * PAGE_BYTES + 4  # not a page multiple, nor a power of two
    block = memory.allocate(nbytes)
    assert block.nbytes == page_round(nbytes) and block.data_ptr() % PAGE_BYTES == 0
    assert backend.pinned_memory_allocated() - before == page_round(nbytes)  # no rounding beyond the page
    assert backend.is_pinned(block) and backend.is_pinned(block[PAGE_BYTES:])
    values = kit.pattern(0, block.nbytes // 4)
    block.view(torch.float32).copy_(values)
    device = backend.empty_device(values.numel(), torch.float32)
    stream = backend.new_stream()
    backend.copy_async(device, block.view(torch.float32), stream)
    stream.synchronize()
    assert torch.equal(kit.download(backend, device), values)
    memory.close()
    assert backend.pinned_memory_allocated() == before and not backend.is_pinned(block)
    assert torch.equal(block.view(torch.float32), values)  # unregistered memory stays valid
