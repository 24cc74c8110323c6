"""Huge pages for the host buffers that reads past the page cache land in.

A read with ``O_DIRECT`` goes to the drive as one request only when its destination's physical
pages fit in the queue's scatter-gather list (``/sys/block/*/queue/max_segments``: 254 on the
development machine's virtio disk, often fewer on NVMe). A 2 MiB read into memory scattered in
4 KiB pages needs up to 512 segments and is split into several requests, and how scattered a
fresh buffer is depends on what the allocator and the kernel did before: on the development
machine the same reads ran at 0.95 to 4.1 GB/s into sets of ``torch.empty`` buffers, each set
at its own speed every time, and at 3.7 to 4.4 GB/s into every set backed by huge pages
(docs/benchmarks.md, the disk tier's note 2). A 2 MiB huge page is one segment.

Linux backs an anonymous range with transparent huge pages when it is advised to
(``MADV_HUGEPAGE``, honoured in THP's default ``madvise`` mode) before its pages are first
touched. Where there is no such advice (another OS, THP off), or for memory already touched
(an allocator's recycled block, memory a driver has pinned), the advice changes nothing and is not
an error: the reads are as fast as before. So the buffers the library makes for this are
mappings of their own (:func:`mapping`, :func:`empty`).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

#: the size of a transparent huge page on the architectures we run on (x86-64, aarch64 with 4 KiB pages)
HUGE_PAGE_BYTES = 2 * 2**20

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)
try:
    _madvise = ctypes.CDLL(None, use_errno=True).madvise if _MADV_HUGEPAGE is not None else None
except (OSError, AttributeError):  # no C library to ask
    _madvise = None
if _madvise is not None:
    _madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def advise(address: int, nbytes: int) -> None:
    """Ask for huge pages on the whole huge pages within ``nbytes`` at ``address`` (a refusal is
    not an error: the memory stays as it was)."""
    begin = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + nbytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if _madvise is not None and end > begin:
        _madvise(begin, end - begin, _MADV_HUGEPAGE)


def mapping(nbytes: int) -> tuple[mmap.mmap, int]:
    """An anonymous mapping holding ``nbytes`` from a huge-page boundary on, advised before any
    page is touched, and the offset of that boundary in it (a page multiple: aligned for
    ``O_DIRECT`` too)."""
    # private: huge pages back shared (shmem) memory only where an administrator allowed it
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    offset = -address % HUGE_PAGE_BYTES
    advise(address + offset, nbytes)
    return buffer, offset


def empty(nbytes: int) -> torch.Tensor:
    """A flat uint8 tensor of ``nbytes`` on memory of its own from a huge-page boundary on (see
    :func:`mapping`): unlike ``torch.empty``, whose allocator may hand back memory already
    touched, where the advice comes too late. The tensor keeps the mapping alive."""
    buffer, start = mapping(nbytes)
    return torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes, offset=start)
