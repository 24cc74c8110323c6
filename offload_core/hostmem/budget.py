"""The machine's host memory: what it has, the shares of it the "auto" budgets take, and handing
freed memory back to the operating system.

What the user may write for ``pinned_memory=`` / ``host_memory=`` is parsed with the other options
(:class:`offload_core.config.Budget`); a fraction of RAM is turned into bytes here, when a
placement is planned, against the RAM of the machine that runs it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os

logger = logging.getLogger(__name__)

#: "auto" pinned budget: at most this share of physical RAM is page-locked, by all of this
#: backend's pinned allocations together. Page-locked memory cannot be swapped or reclaimed, and
#: drivers refuse (or the kernel stalls) well before all of RAM is pinned.
AUTO_PINNED_SHARE = 0.5
#: "auto" host budget of ``from_pretrained``: the share of the memory available when loading
#: starts that weights may take; the rest of the blocks stream from the checkpoint.
AUTO_HOST_SHARE = 0.9

def physical_memory() -> int:
    """Bytes of physical RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """Bytes of RAM the kernel could give this process now without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to trim
        return None


def return_free_memory() -> None:
    """Give memory that the C allocator keeps after large frees back to the operating system.

    glibc raises its mmap threshold after large blocks are freed, so later large buffers come
    from the heap and, once freed, stay in the process: without a trim a second enable/disable
    cycle would start from the first one's peak."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class Trimmer:
    """Returns freed memory to the OS after every ``every`` bytes of weights moved.

    Packing frees each original tensor as its copy is made, and unpacking frees each home as its
    tensors get their own storage again. Tensors below glibc's mmap threshold live on the heap,
    where freed memory is reused only by allocations that fit in the holes; without a trim along
    the way the process would hold the old copy and the new one at once."""

    def __init__(self, every: int = 64 * 2**20) -> None:
        self.every = every
        self._moved = 0

    def add(self, nbytes: int) -> None:
        self._moved += nbytes
        if self._moved >= self.every:
            self.flush()

    def flush(self) -> None:
        """Trim now if more than a few MiB moved since the last trim (a trim costs milliseconds)."""
        if self._moved >= self.every // 16:
            return_free_memory()
        self._moved = 0
