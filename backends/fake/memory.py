"""Allocation accounting for the fake device and its pinned host memory.

Tensors are ordinary CPU tensors; what makes them "device" or "pinned" memory is that a pool
handed them out. The shared :class:`~offload_core.device.memory_accounting.AllocationTracker` gives the
bytes back when the last tensor viewing a storage dies, so ``memory_allocated`` follows tensor
lifetimes the way a caching allocator's does; the real accelerator backends count their pinned
memory with the same class.
"""

from __future__ import annotations

import bisect
import weakref
from typing import Any

import torch

from offload_core.device.memory_accounting import AllocationTracker


class FakeOutOfMemoryError(torch.OutOfMemoryError):
    """The fake device's capacity would be exceeded (a ``torch.OutOfMemoryError``)."""


class Pool(AllocationTracker):
    """A capacity-checked pool of CPU tensors standing in for one kind of fake memory.

    A tensor owns memory of the pool when it views an allocation's storage or a storage sliced
    out of one (``untyped_storage()[a:b]``, what an offloaded weight shows at home): as a real
    pinned allocator answers for any address inside its blocks."""

    def __init__(self, kind: str, capacity: int | None, **model: Any) -> None:
        super().__init__(kind, capacity, oom_error=FakeOutOfMemoryError, **model)
        self.label = f"fake {kind}"  # error messages say "fake device out of memory"
        self._spans = Spans()

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = super().allocate(*args, **kwargs)
        self._spans.add(tensor)
        return tensor

    def owns(self, tensor: torch.Tensor) -> bool:
        # Only CPU tensors can be fake device or pinned memory. Every allocation is in the span
        # index, so one lookup by address answers for a whole storage and for a slice of one
        # (asked on every copy: the allocation table's storage key costs as much again).
        return tensor.is_cpu and tensor.numel() > 0 and self._spans.find(tensor.data_ptr()) is not None


class Spans:
    """Live storages by address, for finding the one an address falls in: a sorted index rebuilt
    lazily after a storage comes (lookups far outnumber allocations).

    A storage's death runs no Python code: its weak reference's callback is the table's own
    ``pop`` (a C method), so no interrupt or lock can stop it half way; the index may still list
    a storage that died since, and a lookup checks that the one it finds is alive."""

    def __init__(self) -> None:
        self._spans: dict[weakref.ref, tuple[int, int]] = {}  # a live storage -> (first byte, end byte)
        # (first bytes in order, (end byte, storage) of each), or None when a storage came since
        self._index: tuple[list[int], list[tuple[int, weakref.ref]]] | None = ([], [])

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        if not storage.nbytes():
            return
        self._spans[weakref.ref(storage, self._spans.pop)] = (start, start + storage.nbytes())
        self._index = None

    def find(self, address: int) -> int | None:
        """The first byte of the live storage holding ``address``, or None."""
        index = self._index
        if index is None:
            spans = sorted(((span, ref) for ref, span in self._spans.copy().items()), key=lambda item: item[0])
            index = self._index = ([start for (start, _), _ in spans], [(end, ref) for (_, end), ref in spans])
        k = bisect.bisect_right(index[0], address) - 1
        if k < 0:
            return None
        end, ref = index[1][k]
        return index[0][k] if address < end and ref() is not None else None
