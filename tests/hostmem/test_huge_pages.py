"""The host buffers that disk reads land in (the bounce ring's, the readers' scratch) are on
huge pages, so that a read past the page cache goes to the drive as one request
(offload_core/hostmem/hugepages.py says why). Checked in /proc/self/smaps, where the kernel says
which of a range's bytes huge pages back."""

from __future__ import annotations

import ctypes
import mmap
import re
import threading
from pathlib import Path

import pytest
import torch

import offload_core
from offload_core.hostmem import direct, hugepages, placement
from offload_core.hostmem.staging import BounceRing

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
pytestmark = [
    pytest.mark.fake_only,
    pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text() or hugepages._madvise is None,
                       reason="no transparent huge pages on this machine"),
]


def huge_bytes(address: int, nbytes: int) -> int:
    """Bytes that huge pages back in the mappings overlapping ``nbytes`` at ``address``."""
    total, overlaps = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            overlaps = int(span[1], 16) < address + nbytes and address < int(span[2], 16)
        elif overlaps and line.startswith("AnonHugePages:"):
            total += int(line.split()[1]) * 1024
    return total


def test_an_advised_mapping_is_backed_by_huge_pages_once_written():
    buffer, start = hugepages.mapping(8 * 2**20)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer)) + start
    assert address % hugepages.HUGE_PAGE_BYTES == 0
    ctypes.memset(address, 1, 8 * 2**20)
    assert huge_bytes(address, 8 * 2**20) >= 8 * 2**20


def fresh(n: int, dtype: torch.dtype) -> torch.Tensor:
    """Memory no one has touched yet, as a driver's fresh pinned allocation may be."""
    mapping = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=torch.uint8).view(dtype)


# memory it is given: all but the partial huge pages at each buffer's two ends; its own (the
# pageable ring's buffers, which torch's allocator may hand back already touched): all of it
@pytest.mark.parametrize("allocate, lost", [(fresh, 2 * hugepages.HUGE_PAGE_BYTES), (placement._ring_buffer, 0)],
                         ids=["fresh memory it is given", "its own pageable buffers"])
def test_the_bounce_rings_buffers_are_on_huge_pages(allocate, lost):
    backend = offload_core.get_backend("fake", chaos=False, sanitize=False)
    ring = BounceRing(backend, allocate, 8 * 2**20)
    for buffer in ring.buffers:
        buffer.fill_(1)
        assert huge_bytes(buffer.data_ptr(), buffer.nbytes) >= buffer.nbytes - lost


def test_a_readers_scratch_buffer_is_on_huge_pages():
    found = []

    def reader() -> None:  # each reader thread has its own
        mapping, start, address = direct._scratch_buffer()
        ctypes.memset(address, 1, direct.PIECE_BYTES)
        found.append(huge_bytes(address, direct.PIECE_BYTES))

    thread = threading.Thread(target=reader)
    thread.start()
    thread.join()
    assert found[0] >= direct.PIECE_BYTES
