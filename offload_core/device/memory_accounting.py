"""Byte accounting that follows tensor lifetimes, shared by every backend that hands out memory.

Allocator statistics cannot answer "how many pinned bytes did *this backend* hand out that are
still alive": a caching allocator keeps freed blocks, and other code in the process allocates
from the same pool. So each tensor a backend allocates is registered here, and its bytes are given
back once the last tensor viewing its storage dies.
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

from ..base.locks import locked

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


class _Allocation(weakref.ref):
    """A tracker's weak reference to a storage it counts, with what the storage's death gives
    back. Its callback is the ``append`` of the tracker's queue of the dead: a C method, so that
    no Python code runs where the storage dies (see :class:`AllocationTracker`)."""

    __slots__ = ("key", "nbytes", "counted")

    def __new__(cls, storage: torch.UntypedStorage, dead: collections.deque, key: tuple[int, int], nbytes: int):
        self = super().__new__(cls, storage, dead.append)
        self.key, self.nbytes, self.counted = key, nbytes, False
        return self

    def __init__(self, storage: torch.UntypedStorage, dead: collections.deque, key: tuple[int, int], nbytes: int):
        super().__init__(storage, dead.append)


class AllocationTracker:
    """Live and peak bytes of the tensors allocated through :meth:`allocate`, with an optional cap.

    The cap is checked before the allocation so that exceeding it raises ``oom_error`` (a
    ``torch.OutOfMemoryError`` by default, what callers of a real device already handle) instead
    of over-committing.

    ``block_size`` models an allocator that rounds requests (``nbytes -> bytes really taken``);
    every figure here counts the rounded bytes. With ``caches_freed`` the model is a caching
    allocator: a freed block stays held (``cached``) until :meth:`empty_cache`, and a later request
    of the same block size reuses it, as torch's caching host allocator does.

    The counts stay exact whatever interrupts them. A storage's death runs no Python code: a
    finalizer runs wherever a garbage collection happens (inside this tracker's lock, on the same
    thread, too), and a Ctrl-C that lands in one is swallowed with its work half done. So a
    death only queues the storage's :class:`_Allocation`, and the next reader of a count gives
    its bytes back, under the lock. Each change of the counts is one statement without a call,
    which no interrupt splits, and sets its allocation's ``counted`` in the same statement: a
    change an interrupt stopped before is made by the next reader, and none is made twice.
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
        self.peak = 0
        self._current = 0  # bytes of live allocations, as of the last give-back
        self._free_blocks: dict[int, int] = {}  # block size -> cached free blocks of it (caches_freed)
        self._live: dict[tuple[int, int], _Allocation] = {}  # storage key -> its allocation
        self._dead: collections.deque[_Allocation] = collections.deque()  # died, not given back yet
        self._lock = threading.RLock()

    @property
    def current(self) -> int:
        """Bytes of live allocations."""
        return locked(self._lock, self._counts)[0]

    @property
    def cached(self) -> int:
        """Bytes of freed blocks still held (``caches_freed``)."""
        return locked(self._lock, self._counts)[1]

    @property
    def held(self) -> int:
        """Bytes the allocator holds: live allocations plus cached free blocks."""
        return sum(locked(self._lock, self._counts))

    def _counts(self) -> tuple[int, int]:
        """(live, cached) bytes (the caller holds the lock)."""
        self._give_back()
        return self._current, sum(size * count for size, count in self._free_blocks.items())

    def allocate(
        self, size: int | Sequence[int], dtype: torch.dtype, factory: Factory = _empty
    ) -> torch.Tensor:
        """A new tensor from ``factory(shape, dtype)``, counted until its storage dies."""
        shape = as_shape(size)
        nbytes = self.block_size(math.prod(shape) * dtype.itemsize)
        return locked(self._lock, self._allocate, shape, dtype, nbytes, factory)

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype, nbytes: int, factory: Factory) -> torch.Tensor:
        current, cached = self._counts()
        reused = self._free_blocks.get(nbytes, 0) > 0
        if not reused and self.capacity is not None and current + cached + nbytes > self.capacity:
            raise self.oom_error(
                f"{self.label} out of memory: tried to allocate {nbytes} bytes with "
                f"{current + cached} of {self.capacity} bytes in use"
            )
        tensor = factory(shape, dtype)
        if not nbytes:
            return tensor
        key = _storage_key(tensor)
        allocation = _Allocation(tensor.untyped_storage(), self._dead, key, nbytes)
        self._live[key] = allocation  # uncounted until the statement below: its death changes nothing
        self.peak = max(self.peak, self._current + nbytes)
        if reused:  # one statement, no call: counted entirely or not at all (see the class docstring)
            self._current, self._free_blocks[nbytes], allocation.counted = (
                self._current + nbytes, self._free_blocks[nbytes] - 1, True)
        else:
            self._current, allocation.counted = self._current + nbytes, True
        return tensor

    def _give_back(self) -> None:
        """The bytes of the storages that died (the caller holds the lock). Each step can be
        interrupted and run again: the entry goes only while it is this allocation's, the counts
        change in one statement that clears ``counted``, the queue is popped last."""
        while self._dead:
            gone = self._dead[0]
            if self._live.get(gone.key) is gone:
                del self._live[gone.key]
            if gone.counted and self.caches_freed:
                self._free_blocks.setdefault(gone.nbytes, 0)
                self._current, self._free_blocks[gone.nbytes], gone.counted = (
                    self._current - gone.nbytes, self._free_blocks[gone.nbytes] + 1, False)
            elif gone.counted:
                self._current, gone.counted = self._current - gone.nbytes, False
            self._dead.popleft()

    def empty_cache(self) -> int:
        """Give the cached free blocks back; returns their bytes."""
        return locked(self._lock, self._empty_cache)

    def _empty_cache(self) -> int:
        freed = self._counts()[1]
        self._free_blocks = {}
        return freed

    def owns(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` views (part of) a live allocation made here."""
        if tensor.numel() == 0:
            return False
        allocation = self._live.get(_storage_key(tensor))  # a dict lookup is atomic; no lock needed
        return allocation is not None and allocation() is not None  # not one that died at that address

    def reset_peak(self) -> None:
        locked(self._lock, self._reset_peak)

    def _reset_peak(self) -> None:
        self.peak = self._counts()[0]


class HostRegistrations:
    """Host ranges a backend page-locked through its runtime (``cudaHostRegister``), by first
    byte: the bytes they pin, and whether an address falls in one (``is_pinned``). Registering a
    range twice, or unregistering one that is not registered, is refused as the runtimes refuse it.

    The ranges are one snapshot, replaced whole by each change (one assignment: no interrupt
    leaves it half changed, and readers need no lock); changes are made one at a time, under a
    lock taken through :func:`~offload_core.base.locks.locked`. A registered block's finalizer
    unregisters it wherever a garbage collection runs, also inside ``add`` on the same thread,
    hence a re-entrant lock: the nested change is made on the snapshot it finds.
    """

    def __init__(self) -> None:
        self._ranges: tuple[tuple[int, int], ...] = ()  # (first byte, end byte), sorted
        self._lock = threading.RLock()

    @property
    def bytes(self) -> int:
        return sum(end - start for start, end in self._ranges)

    def check(self, ptr: int, nbytes: int) -> None:
        """Refuse, before the runtime is asked, a range it would refuse: not page-aligned, empty,
        or overlapping one registered already."""
        if ptr % PAGE_BYTES or nbytes <= 0:
            raise ValueError(f"host registration needs page-aligned memory, got {nbytes} bytes at {ptr:#x}")
        ranges = self._ranges
        k = bisect.bisect_left(ranges, (ptr,))
        if (k > 0 and ranges[k - 1][1] > ptr) or (k < len(ranges) and ranges[k][0] < ptr + nbytes):
            raise ValueError(f"host memory at {ptr:#x} ({nbytes} bytes) is already registered")

    def add(self, ptr: int, nbytes: int) -> None:
        """Count a range the runtime registered (``check`` it first)."""
        locked(self._lock, self._add, ptr, nbytes)

    def _add(self, ptr: int, nbytes: int) -> None:
        self.check(ptr, nbytes)
        ranges = self._ranges
        k = bisect.bisect_left(ranges, (ptr,))
        self._ranges = (*ranges[:k], (ptr, ptr + nbytes), *ranges[k:])

    def remove(self, ptr: int) -> int:
        """Forget the range starting at ``ptr``; returns its bytes."""
        return locked(self._lock, self._remove, ptr)

    def _remove(self, ptr: int) -> int:
        ranges = self._ranges
        k = bisect.bisect_left(ranges, (ptr,))
        if k == len(ranges) or ranges[k][0] != ptr:
            raise ValueError(f"host memory at {ptr:#x} is not registered")
        self._ranges = (*ranges[:k], *ranges[k + 1:])
        return ranges[k][1] - ptr

    def covers(self, ptr: int) -> bool:
        ranges = self._ranges
        k = bisect.bisect_right(ranges, (ptr, math.inf)) - 1
        return k >= 0 and ptr < ranges[k][1]
