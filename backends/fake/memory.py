"""Allocation accounting for the fake device and its pinned host memory.

Tensors are ordinary CPU tensors; what makes them "device" or "pinned" memory is that a pool
handed them out. The shared :class:`~offload_core.memory_accounting.AllocationTracker` gives the
bytes back when the last tensor viewing a storage dies, so ``memory_allocated`` follows tensor
lifetimes the way a caching allocator's does; the real accelerator backends count their pinned
memory with the same class.
"""

from __future__ import annotations

from typing import Any

import torch

from offload_core.memory_accounting import AllocationTracker


class FakeOutOfMemoryError(torch.OutOfMemoryError):
    """The fake device's capacity would be exceeded (a ``torch.OutOfMemoryError``)."""


class Pool(AllocationTracker):
    """A capacity-checked pool of CPU tensors standing in for one kind of fake memory."""

    def __init__(self, kind: str, capacity: int | None, **model: Any) -> None:
        super().__init__(kind, capacity, oom_error=FakeOutOfMemoryError, **model)
        self.label = f"fake {kind}"  # error messages say "fake device out of memory"

    def owns(self, tensor: torch.Tensor) -> bool:
        # Only CPU tensors can be fake device or pinned memory.
        return tensor.device.type == "cpu" and super().owns(tensor)
