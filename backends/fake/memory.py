"""Allocation accounting for the fake device and its pinned host memory.

Tensors are ordinary CPU tensors; what makes them "device" or "pinned" memory is that a pool
handed them out. A finalizer on each storage gives the bytes back when the last tensor viewing it
dies, so ``memory_allocated`` follows tensor lifetimes the way a caching allocator's does.
"""

from __future__ import annotations

import math
import threading
import weakref
from typing import Sequence

import torch


class FakeOutOfMemoryError(torch.OutOfMemoryError):
    """The fake device's capacity would be exceeded (a ``torch.OutOfMemoryError``)."""


def _shape(size: int | Sequence[int]) -> tuple[int, ...]:
    return (int(size),) if isinstance(size, int) else tuple(int(s) for s in size)


class Pool:
    def __init__(self, kind: str, capacity: int | None) -> None:
        self.kind = kind
        self.capacity = capacity
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}  # storage data_ptr -> bytes
        self._lock = threading.Lock()

    def allocate(self, size: int | Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        shape = _shape(size)
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            if self.capacity is not None and self.current + nbytes > self.capacity:
                raise FakeOutOfMemoryError(
                    f"fake {self.kind} out of memory: tried to allocate {nbytes} bytes with "
                    f"{self.current} of {self.capacity} bytes in use"
                )
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        tensor = torch.empty(shape, dtype=dtype)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            if nbytes:
                self._live[key] = nbytes
        weakref.finalize(storage, self._release, key, nbytes)
        return tensor

    def _release(self, key: int, nbytes: int) -> None:
        with self._lock:
            self.current -= nbytes
            if nbytes:
                self._live.pop(key, None)

    def owns(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type != "cpu" or tensor.numel() == 0:
            return False
        with self._lock:
            return tensor.untyped_storage().data_ptr() in self._live

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current
