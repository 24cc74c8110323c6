"""OffloadHandle: what ``enable_offload`` returns, and the only way to undo it."""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Protocol, Sequence

from .backend import DeviceBackend
from .hostmem.budget import Trimmer
from .timeline import Timeline

logger = logging.getLogger(__name__)

HANDLE_ATTRIBUTE = "_offload_core_handle"


class Part(Protocol):
    """One strategy instance inside a handle (a streamed DiT, a pipeline's component swapper)."""

    counters: Any
    device_weight_bytes: int
    host_bytes: int
    timeline: Timeline | None  # set while a trace records; the strategy records into it

    def disable(self) -> None: ...


class AlreadyEnabledError(RuntimeError):
    """``enable_offload`` on a target that already has offloading enabled."""


class OffloadHandle:
    """Live offloading of one target. ``disable()`` restores ordinary host tensors."""

    def __init__(
        self,
        target: Any,
        strategy: str,
        backend: DeviceBackend,
        parts: Sequence[Part],
        baseline: int,
        undo: Sequence = (),
        *,
        placement: Any,
    ) -> None:
        self.target = target
        self.strategy = strategy
        self.backend = backend
        self.parts = list(parts)
        self._undo = list(undo)
        self.enabled = True
        self._baseline = baseline  # device bytes other users of the backend held before enable
        self.placement = placement  # where the weights' host homes are (hostmem.placement)

    @property
    def device_weight_bytes(self) -> int:
        return sum(p.device_weight_bytes for p in self.parts)

    def stats(self) -> dict[str, int]:
        """Transfer and memory figures since enable.

        ``device_peak_bytes`` is the backend's peak allocation since enable, less what other users
        of the backend held before it; ``device_weight_bytes`` the device memory the strategy
        itself holds at most. Host side: ``pinned_host_bytes`` (weights in pinned memory, and the
        bounce ring), ``pageable_host_bytes`` (weights in ordinary memory), ``disk_bytes``
        (weights read from disk), ``bounce_bytes`` (the ring) and ``staged_bytes`` (bytes copied
        through the ring so far); ``host_bytes`` is the weights held in RAM.
        """
        totals = {"h2d_bytes": 0, "h2d_copies": 0, "prefetch_misses": 0, "loads": 0}
        for part in self.parts:
            for key, value in part.counters.as_dict().items():
                totals[key] = totals.get(key, 0) + value
        totals["device_peak_bytes"] = max(self.backend.max_memory_allocated() - self._baseline, 0)
        totals["device_weight_bytes"] = self.device_weight_bytes
        totals.update(self.placement.stats())
        totals["host_bytes"] = sum(p.host_bytes for p in self.parts) - totals["disk_bytes"]
        return totals

    @contextlib.contextmanager
    def trace(self) -> Iterator[Timeline]:
        """Record what the strategies do inside the block (per-block compute, copies, waits,
        misses) into a :class:`~offload_core.timeline.Timeline`, closed on exit so that its spans
        can be read. One trace at a time; without one, recording costs nothing."""
        if any(part.timeline is not None for part in self.parts):
            raise RuntimeError("a trace is already recording on this handle")
        timeline = Timeline(self.backend)
        for part in self.parts:
            part.timeline = timeline
        try:
            yield timeline
        finally:
            for part in self.parts:
                part.timeline = None
            timeline.close()

    def disable(self) -> None:
        """Remove every hook, put the weights back in ordinary host tensors, free device memory.
        Calling it again does nothing."""
        if not self.enabled:
            return
        for part in reversed(self.parts):
            part.disable()
        for fn in reversed(self._undo):
            fn()
        self.placement.close()
        self.enabled = False
        trimmer = Trimmer()
        trimmer.add(sum(p.host_bytes for p in self.parts))  # the homes just freed, device buffers on CPU backends
        trimmer.flush()
        logger.info("offload (%s) disabled on %s", self.strategy, type(self.target).__name__)

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"<OffloadHandle {self.strategy} on {type(self.target).__name__} via {self.backend.name}: {state}>"
