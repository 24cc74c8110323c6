"""Tensors stored in files, as the models built from checkpoints carry them: where one lies
(:class:`FileSlice`), and reading it with positional reads.

It sits with the weights, beneath the host-memory tiers: a model's meta tensors carry their slices
(:mod:`.checkpoint`), while :mod:`offload_core.hostmem` opens the files and reads the slices into
homes and bounce buffers, past the page cache in requests aligned to :data:`ALIGN`.
"""

from __future__ import annotations

import contextlib
import os
from typing import Protocol

import torch

#: the alignment of a read past the page cache (``O_DIRECT``): its file offset, length and memory
#: address (4 KiB: 512-byte and 4 KiB devices)
ALIGN = 4096
#: a file slice this large has its whole pages read straight into place where the bounce ring lays
#: it out as its file does within a page, and its bytes count in choosing that layout (a smaller
#: one goes through a scratch buffer: its pages are mostly partial anyway)
DIRECT_MIN_BYTES = 64 * 2**10


def as_bytes(t: torch.Tensor) -> memoryview:
    """The memory of a flat contiguous tensor as a writable byte buffer."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def pread_into(fd: int, out: torch.Tensor, offset: int) -> None:
    """Fill ``out`` (flat, contiguous) with the bytes of ``fd`` at ``offset``."""
    if out.numel() == 0:
        return
    pread_exact(fd, as_bytes(out), offset)


def pread_exact(fd: int, buffer, offset: int, need: int | None = None, tensor_offset: int | None = None) -> None:
    """Fill ``buffer`` (any writable buffer) with the bytes of ``fd`` from ``offset`` until ``need``
    bytes (default: all of it) have come; a file that ends first raises ``EOFError``, naming the
    offset of the tensor the read belongs to (default: ``offset``)."""
    view = memoryview(buffer).cast("B")
    need = len(view) if need is None else need
    got = 0
    try:
        while got < need:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                where = offset if tensor_offset is None else tensor_offset
                raise EOFError(f"file ends {need - got} bytes short of a tensor at offset {where}")
            got += n
    finally:
        view.release()


class File(Protocol):
    """A file slices are read from (``offload_core.hostmem.disk.DataFile``)."""

    def reading(self) -> contextlib.AbstractContextManager[int]:
        """An open descriptor of the file while the context lasts."""


class FileSlice:
    """A tensor stored in a file; reads any element range, converting to the reader's dtype."""

    __slots__ = ("file", "offset", "dtype", "shape")

    def __init__(self, file: File, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.file = file
        self.offset = offset  # absolute byte offset of the first element
        self.dtype = dtype
        self.shape = shape

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def read(self, start: int, count: int, out: torch.Tensor) -> int:
        """Elements ``start .. start + count`` into ``out`` (flat); one read, plus a conversion
        through a buffer of this slice's size when the dtypes differ. Returns the bytes read."""
        where = self.offset + start * self.dtype.itemsize
        raw = out if out.dtype == self.dtype else torch.empty(count, dtype=self.dtype)
        with self.file.reading() as fd:
            pread_into(fd, raw, where)
        if raw is not out:
            out.copy_(raw)
        return count * self.dtype.itemsize
