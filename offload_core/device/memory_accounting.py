"""Byte accounting that follows tensor lifetimes, shared by every backend that hands out memory.

Allocator statistics cannot answer "how many pinned bytes did *this backend* hand out that are
still alive": a caching allocator keeps freed blocks, and other code in the process allocates
from the same pool. So each tensor a backend allocates is registered here, and a finalizer on its
storage gives the bytes back when the last tensor viewing that storage dies.
"""

from __future__ import annotations

import bisect
import collections
import math
import mmap
import threading
import weakref
from typing import Callable, Sequence

import torch

__all__ = ["AllocationTracker", "HostRegistrations", "as_shape", "power_of_two_ceil"]

#: the granularity of host registration: ranges start at page boundaries
PAGE_BYTES = mmap.PAGESIZE

Factory = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


def as_shape(size: int | Sequence[int]) -> tuple[int, ...]:
    """The backend API takes a number of elements or a shape; torch wants a shape."""
    return (int(size),) if isinstance(size, int) else tuple(int(s) for s in size)


def power_of_two_ceil(nbytes: int) -> int:
    """The block torch's caching host allocator takes for a request of ``nbytes``: the next power
    of two (torch's ``host_memory_stats`` documents the rounding)."""
    return 1 << max(int(nbytes) - 1, 0).bit_length() if nbytes > 0 else 0


def _empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    """(device index, -1 for host memory; address of the storage's first byte), read without
    building a storage or device object: ``owns`` sits on every copy's path. One tracker counts
    one kind of memory, so the address and index identify a storage within it."""
    return t.get_device(), t.data_ptr() - t.storage_offset() * t.element_size()


class AllocationTracker:
    """Live and peak bytes of the tensors allocated through :meth:`allocate`, with an optional cap.

    The cap is checked before the allocation so that exceeding it raises ``oom_error`` (a
    ``torch.OutOfMemoryError`` by default, what callers of a real device already handle) instead
    of over-committing.

    ``block_size`` models an allocator that rounds requests (``nbytes -> bytes really taken``);
    every figure here counts the rounded bytes. With ``caches_freed`` the model is a caching
    allocator: a freed block stays held (``cached``) until :meth:`empty_cache`, and a later request
    of the same block size reuses it, as torch's caching host allocator does.
    """

    def __init__(
        self,
        kind: str,
        capacity: int | None = None,
        oom_error: type[Exception] = torch.OutOfMemoryError,
        block_size: Callable[[int], int] | None = None,
        caches_freed: bool = False,
    ) -> None:
        self.kind = kind
        self.label = kind  # how the out-of-memory message names this memory
        self.capacity = capacity
        self.oom_error = oom_error
        self.block_size = block_size or (lambda nbytes: nbytes)
        self.caches_freed = caches_freed
        self.current = 0  # bytes of live allocations
        self.cached = 0  # bytes of freed blocks still held (caches_freed only)
        self.peak = 0
        self._free_blocks: collections.Counter[int] = collections.Counter()  # block size -> count
        self._live: dict[tuple[int, int], int] = {}  # storage key -> bytes
        self._lock = threading.RLock()  # a storage finalizer may run (GC) while the lock is held

    @property
    def held(self) -> int:
        """Bytes the allocator holds: live allocations plus cached free blocks."""
        return self.current + self.cached

    def allocate(
        self, size: int | Sequence[int], dtype: torch.dtype, factory: Factory = _empty
    ) -> torch.Tensor:
        """A new tensor from ``factory(shape, dtype)``, counted until its storage dies."""
        shape = as_shape(size)
        nbytes = self.block_size(math.prod(shape) * dtype.itemsize)
        with self._lock:
            reused = self._free_blocks[nbytes] > 0
            if reused:
                self._free_blocks[nbytes] -= 1
                self.cached -= nbytes
            elif self.capacity is not None and self.held + nbytes > self.capacity:
                raise self.oom_error(
                    f"{self.label} out of memory: tried to allocate {nbytes} bytes with "
                    f"{self.held} of {self.capacity} bytes in use"
                )
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        try:
            tensor = factory(shape, dtype)
        except BaseException:
            with self._lock:  # the reservation above must not leak when the allocator refuses
                self.current -= nbytes
                if reused:
                    self._free_blocks[nbytes] += 1
                    self.cached += nbytes
            raise
        key = _storage_key(tensor)
        with self._lock:
            if nbytes:
                self._live[key] = nbytes
        weakref.finalize(tensor.untyped_storage(), self._release, key, nbytes)
        return tensor

    def _release(self, key: tuple[int, int], nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes
            if nbytes:
                self._live.pop(key, None)
            if self.caches_freed and nbytes:
                self._free_blocks[nbytes] += 1
                self.cached += nbytes

    def empty_cache(self) -> int:
        """Give the cached free blocks back; returns their bytes."""
        with self._lock:
            freed, self.cached = self.cached, 0
            self._free_blocks.clear()
        return freed

    def owns(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` views (part of) a live allocation made here."""
        if tensor.numel() == 0:
            return False
        return _storage_key(tensor) in self._live  # a dict lookup is atomic; no lock needed

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current


class HostRegistrations:
    """Host ranges a backend page-locked through its runtime (``cudaHostRegister``), by first
    byte: the bytes they pin, and whether an address falls in one (``is_pinned``). Registering a
    range twice, or unregistering one that is not registered, is refused as the runtimes refuse it."""

    def __init__(self) -> None:
        self._ends: dict[int, int] = {}  # first byte -> end byte
        self._starts: list[int] = []  # sorted
        self.bytes = 0
        self._lock = threading.Lock()

    def check(self, ptr: int, nbytes: int) -> None:
        """Refuse, before the runtime is asked, a range it would refuse: not page-aligned, empty,
        or overlapping one registered already."""
        if ptr % PAGE_BYTES or nbytes <= 0:
            raise ValueError(f"host registration needs page-aligned memory, got {nbytes} bytes at {ptr:#x}")
        k = bisect.bisect_right(self._starts, ptr)
        if (k > 0 and self._ends[self._starts[k - 1]] > ptr) or (k < len(self._starts) and self._starts[k] < ptr + nbytes):
            raise ValueError(f"host memory at {ptr:#x} ({nbytes} bytes) is already registered")

    def add(self, ptr: int, nbytes: int) -> None:
        """Count a range the runtime registered (``check`` it first)."""
        with self._lock:
            self.check(ptr, nbytes)
            k = bisect.bisect_right(self._starts, ptr)
            self._starts.insert(k, ptr)
            self._ends[ptr] = ptr + nbytes
            self.bytes += nbytes

    def remove(self, ptr: int) -> int:
        """Forget the range starting at ``ptr``; returns its bytes."""
        with self._lock:
            end = self._ends.pop(ptr, None)
            if end is None:
                raise ValueError(f"host memory at {ptr:#x} is not registered")
            self._starts.remove(ptr)
            self.bytes -= end - ptr
            return end - ptr

    def covers(self, ptr: int) -> bool:
        starts = self._starts
        k = bisect.bisect_right(starts, ptr) - 1
        if k < 0:
            return False
        end = self._ends.get(starts[k])
        return end is not None and ptr < end
