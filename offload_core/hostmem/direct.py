"""Reads of weights on disk that bypass the page cache, several requests in flight.

A block on disk is read in every forward. Read through the page cache, one request at a time,
each byte is copied by the kernel from its cache into the bounce buffer on the stager's thread (a
core per few GB/s, which a busy machine starves), every page goes through the cache's allocation
and reclaim, and a drive that serves many requests at once waits for the next. Read with
``O_DIRECT`` the drive writes straight into this process's memory, and :func:`read` keeps up to
:data:`READERS` requests in flight, one per reader thread.

``O_DIRECT`` needs the file offset, the length and the memory address aligned to the device's
logical block size (:data:`ALIGN` covers every common one). A tensor in a safetensors file starts
anywhere, and its place in the bounce buffer is set by its unit's layout and the ring. Where the
two lie alike within a page (the layout and the ring see to it for large tensors), the whole
pages of a piece are read straight into place, and only its partial first and last pages go
through the reader's own aligned scratch buffer; a piece whose two differ is read whole as the
aligned range that covers it into the scratch buffer and copied from there into place (a copy of
each byte, in user space, which costs a core per few GB/s). A file system
that refuses ``O_DIRECT`` (tmpfs) is read through the page cache, as are files when
:data:`ENABLED` is False. Descriptors opened with ``O_DIRECT`` come from a cache of their own,
bounded as the page-cache readers' is (:mod:`.descriptors`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import mmap
import os
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Sequence

from ..weights.slices import ALIGN, pread_exact
from . import hugepages
from .descriptors import DescriptorCache

#: the most one request reads (and each reader's scratch buffer, less the alignment slack)
PIECE_BYTES = 2 * 2**20
#: requests in flight: a drive's queue is deeper, but eight of 2 MiB keep an NVMe drive streaming
READERS = 8
#: False: every file is read through the page cache (the read-ahead's path)
ENABLED = True

#: one read: (file descriptor opened with O_DIRECT, file offset, destination address, bytes)
Job = tuple[int, int, int, int]

#: descriptors opened with O_DIRECT, by file
DESCRIPTORS = DescriptorCache(flags=getattr(os, "O_DIRECT", 0))
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=DESCRIPTORS._after_fork)
_refused: weakref.WeakSet = weakref.WeakSet()  # files whose file system refused O_DIRECT
_pool: tuple[int, ThreadPoolExecutor] | None = None  # (the process that made it, the readers)
_pool_lock = threading.Lock()
_scratch = threading.local()
_count_lock = threading.Lock()
#: bytes copied from the readers' scratch buffers into place since the process started (the rest
#: of what :func:`read` read went straight into place)
scratch_bytes = 0


def usable(file) -> bool:
    """Whether ``file`` (a :class:`~.disk.DataFile`) is read past the page cache: the first ask
    opens it so (and keeps the descriptor in the cache); a file system that refuses says so once."""
    if not ENABLED or not hasattr(os, "O_DIRECT") or file in _refused:
        return False
    try:
        with DESCRIPTORS.reading(file):
            return True
    except OSError:  # EINVAL: the file system does not do direct I/O
        _refused.add(file)
        return False


def reading(file) -> contextlib.AbstractContextManager[int]:
    """A descriptor of ``file`` reading past the page cache, open until the block ends (only for
    a file :func:`usable` said yes to)."""
    return DESCRIPTORS.reading(file)


def read(jobs: Sequence[Job]) -> None:
    """Do every job, its pieces spread over the reader threads; returns once all have landed,
    raising the first failure (``EOFError`` for a file shorter than a job needs)."""
    pieces = _pieces(jobs)
    if len(pieces) == 1:
        _read_piece(pieces[0])
    else:
        submit(jobs)()


def _pieces(jobs: Sequence[Job]) -> list[Job]:
    return [(fd, offset + done, address + done, min(PIECE_BYTES, nbytes - done))
            for fd, offset, address, nbytes in jobs for done in range(0, nbytes, PIECE_BYTES)]


def submit(jobs: Sequence[Job]) -> Callable[[], None]:
    """Queue every job's pieces on the reader threads and return at once; the returned function
    returns once all have landed (a failed piece's neighbours too: none still writes into the
    destination), raising the first failure. A caller that keeps several submissions in flight
    keeps the drive's queue deeper than one submission's pieces."""
    readers = _readers()
    futures = [readers.submit(_read_piece, piece) for piece in _pieces(jobs)]

    def landed() -> None:
        concurrent.futures.wait(futures)
        for future in futures:
            future.result()

    return landed


def _readers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():  # a forked child has none of its parent's threads
            _pool = (os.getpid(), ThreadPoolExecutor(READERS, thread_name_prefix="offload-core-read"))
        return _pool[1]


def _read_piece(piece: Job) -> None:
    """``piece`` into place: where its destination address and file offset lie alike within a
    page, the whole pages between them straight into the destination, and only the partial first
    and last pages through the scratch buffer; elsewhere the aligned range covering all of it."""
    fd, offset, address, nbytes = piece
    head = -offset % ALIGN
    if (address - offset) % ALIGN or nbytes < head + ALIGN:
        _through_scratch(fd, offset, address, nbytes)
        return
    body = (nbytes - head) // ALIGN * ALIGN
    if head:
        _through_scratch(fd, offset, address, head)
    pread_exact(fd, (ctypes.c_char * body).from_address(address + head), offset + head, tensor_offset=offset)
    if nbytes > head + body:
        _through_scratch(fd, offset + head + body, address + head + body, nbytes - head - body)


def _through_scratch(fd: int, offset: int, address: int, nbytes: int) -> None:
    """The aligned range covering ``nbytes`` at ``offset`` into this thread's scratch buffer, then
    its bytes to ``address``."""
    global scratch_bytes
    begin = offset - offset % ALIGN
    end = -(-(offset + nbytes) // ALIGN) * ALIGN
    scratch, start, base = _scratch_buffer()
    with memoryview(scratch)[start : start + end - begin] as view:
        pread_exact(fd, view, begin, offset + nbytes - begin, tensor_offset=offset)
    ctypes.memmove(address, base + offset - begin, nbytes)  # a foreign call: the GIL is released
    with _count_lock:
        scratch_bytes += nbytes


def _scratch_buffer() -> tuple[mmap.mmap, int, int]:
    """This thread's scratch buffer: an anonymous mapping, where the buffer starts in it (on a
    huge page: :mod:`.hugepages`) and that start's address; made anew where :data:`PIECE_BYTES`
    has grown since this thread made it."""
    size = PIECE_BYTES + 2 * ALIGN
    if getattr(_scratch, "buffer", None) is None or len(_scratch.buffer[0]) - _scratch.buffer[1] < size:
        buffer, start = hugepages.mapping(size)
        _scratch.buffer = (buffer, start, ctypes.addressof(ctypes.c_char.from_buffer(buffer)) + start)
    return _scratch.buffer
