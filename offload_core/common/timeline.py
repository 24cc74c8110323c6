"""What the strategies did on the device, lane by lane, recorded the same way on every backend.

A :class:`Timeline` is filled by the strategies themselves while it is attached
(:meth:`offload_core.OffloadHandle.trace`), so it knows what a backend's own profiler cannot: which
block a stretch of compute belongs to, which copy loads which block, when compute stalled for a
copy, and when a block had to be loaded synchronously. It has

* **lanes**: ``"compute"`` (the stream the model runs on) and one ``"copy"`` lane per copy stream
  (``"copy"``, ``"copy 2"``, ... in order of first use), plus ``"host"`` for host-side events;
* **spans** of three kinds: ``compute`` (a block, or a model-level group while it is active, named
  after it), ``copy`` (the transfers that load a block or group, named ``"load <name>"``) and
  ``wait`` (the compute stream held until a copy was done, named ``"wait <name>"``);
* **instants**: host waits (the host blocked until device work finished; the duration is kept in
  ``duration_ns``) and prefetch misses (a block loaded synchronously because it was not in its slot).

Times come from the device where the backend offers it (:data:`offload_core.Capability.TIMING`):
each span edge is an event with timing recorded on its stream, and after the run every event is
placed on the host clock through one reference event, so a span says when the *device* did the work,
not when the host asked for it. A backend without timing gets host times (when the work was issued);
:attr:`Timeline.device_timed` says which, and the overlap figure is then unknown (``None``).

Recording costs nothing when no timeline is attached: the strategies test one attribute per hook.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from typing import Any, Callable, Iterator, TypeVar

from ..device.backend import Capability, DeviceBackend, Stream

COMPUTE_LANE = "compute"
COPY_LANE = "copy"
HOST_LANE = "host"
KINDS = ("compute", "copy", "wait")

T = TypeVar("T")
#: what strategies enter instead of a recording context when nothing is traced (reusable)
UNTRACED = contextlib.nullcontext()
now_ns = time.perf_counter_ns


@dataclasses.dataclass(frozen=True)
class Span:
    lane: str
    name: str
    kind: str  # one of KINDS
    start_ns: int
    end_ns: int
    nbytes: int = 0

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


@dataclasses.dataclass(frozen=True)
class Instant:
    lane: str
    name: str
    kind: str  # "host wait" | "prefetch miss"
    at_ns: int
    duration_ns: int = 0


class Timeline:
    """Spans and instants of one traced stretch of work on ``backend``.

    Strategies call :meth:`copy`, :meth:`compute_after`, :meth:`end_compute`,
    :meth:`host_wait` and :meth:`prefetch_miss`; readers call :meth:`close` (done by
    ``handle.trace()`` on exit) and then :meth:`spans` / :meth:`instants`. ``max_spans`` bounds the
    memory of long runs; spans past it are counted in :attr:`dropped`.
    """

    def __init__(self, backend: DeviceBackend, max_spans: int = 100_000) -> None:
        self.backend = backend
        self.device_timed = Capability.TIMING in backend.capabilities
        self.dropped = 0
        self._max = max_spans
        self._lanes: dict[int, str] = {}
        self._copy_lanes = 0
        self._open: tuple[str, Any] | None = None  # the compute span under way: (name, start marker)
        self._pending: list[tuple[str, str, str, Any, Any, int]] = []
        self._instants: list[Instant] = []
        self._spans: list[Span] | None = None
        self._reference: Any = None
        self._origin_ns = now_ns()
        if self.device_timed:
            # One event the host knows the time of: every other event is placed relative to it.
            self._reference = backend.new_event(timing=True)
            self._reference.record(backend.current_stream())
            self._reference.synchronize()
            self._origin_ns = now_ns()

    # -- recording (called by the strategies) --------------------------------------------
    def copy(self, stream: Stream, name: str, nbytes: int, issue: Callable[[], T]) -> T:
        """Run ``issue()`` (which queues copies on ``stream``) between two markers on ``stream``."""
        start = self._mark(stream)
        result = issue()
        self._add(self._copy_lane(stream), f"load {name}", "copy", start, self._mark(stream), nbytes)
        return result

    @contextlib.contextmanager
    def compute_after(self, stream: Stream, name: str) -> Iterator[None]:
        """Around the strategy's wait of the compute ``stream`` for a copy: recorded as a ``wait``
        span, after which the compute span ``name`` opens; it lasts until :meth:`end_compute`.
        The strategy waits itself, so that each wait is one statement whether traced or not."""
        self.end_compute(stream)
        before = self._mark(stream)
        yield
        after = self._mark(stream)
        self._add(COMPUTE_LANE, f"wait {name}", "wait", before, after, 0)
        self._open = (name, after)

    def end_compute(self, stream: Stream) -> None:
        """Close the open compute span, if any: all of its work has been issued on ``stream``."""
        if self._open is not None:
            name, start = self._open
            self._open = None
            self._add(COMPUTE_LANE, name, "compute", start, self._mark(stream), 0)

    @contextlib.contextmanager
    def host_wait(self, name: str) -> Iterator[None]:
        """Around a host-blocking wait of the strategy's: an instant with its duration."""
        start = now_ns()
        try:
            yield
        finally:
            self._instant(Instant(HOST_LANE, name, "host wait", start - self._origin_ns, now_ns() - start))

    def prefetch_miss(self, name: str) -> None:
        self._instant(Instant(COMPUTE_LANE, f"prefetch miss {name}", "prefetch miss", now_ns() - self._origin_ns))

    # -- reading ----------------------------------------------------------------------------
    def close(self) -> None:
        """Wait for the device, then turn every marker into nanoseconds since the timeline began.
        Idempotent; recording after it is an error."""
        if self._spans is not None:
            return
        self.end_compute(self.backend.current_stream())
        self.backend.synchronize()
        spans = [
            Span(lane, name, kind, self._ns(start), self._ns(end), nbytes)
            for lane, name, kind, start, end, nbytes in self._pending
        ]
        self._pending = []
        self._spans = sorted(spans, key=lambda s: (s.start_ns, s.end_ns))

    def spans(self) -> list[Span]:
        self.close()
        assert self._spans is not None
        return list(self._spans)

    def instants(self) -> list[Instant]:
        return sorted(self._instants, key=lambda i: i.at_ns)

    def lanes(self) -> list[str]:
        """Lane names in display order: compute, the copy lanes, host (those that have events)."""
        used = {s.lane for s in self.spans()} | {i.lane for i in self.instants()}
        order = [COMPUTE_LANE, *sorted((lane for lane in used if lane.startswith(COPY_LANE)), key=_lane_key), HOST_LANE]
        return [lane for lane in order if lane in used]

    def chrome_trace(self) -> dict[str, Any]:
        """The timeline in the Trace Event Format (Perfetto, chrome://tracing): one row per lane."""
        tid = {lane: i for i, lane in enumerate(self.lanes())}
        events: list[dict[str, Any]] = [
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}} for lane, i in tid.items()
        ]
        events += [{"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": i, "args": {"sort_index": i}}
                   for i in tid.values()]
        for s in self.spans():
            args: dict[str, Any] = {"kind": s.kind}
            if s.nbytes:
                args["bytes"] = s.nbytes
            events.append(
                {"name": s.name, "cat": s.kind, "ph": "X", "pid": 0, "tid": tid[s.lane], "ts": s.start_ns / 1e3,
                 "dur": (s.end_ns - s.start_ns) / 1e3, "args": args}
            )
        for i in self.instants():
            events.append(
                {"name": i.name, "cat": i.kind, "ph": "i", "s": "t", "pid": 0, "tid": tid[i.lane], "ts": i.at_ns / 1e3,
                 "args": {"kind": i.kind, "duration_us": i.duration_ns / 1e3}}
            )
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(), f)

    # -- internals --------------------------------------------------------------------------
    def _mark(self, stream: Stream) -> Any:
        if not self.device_timed:
            return now_ns()
        event = self.backend.new_event(timing=True)
        event.record(stream)
        return event

    def _ns(self, marker: Any) -> int:
        if isinstance(marker, int):
            return marker - self._origin_ns
        return round(self._reference.elapsed_time(marker) * 1e6)

    def _copy_lane(self, stream: Stream) -> str:
        lane = self._lanes.get(id(stream))
        if lane is None:
            self._copy_lanes += 1
            lane = self._lanes[id(stream)] = COPY_LANE if self._copy_lanes == 1 else f"{COPY_LANE} {self._copy_lanes}"
        return lane

    def _add(self, lane: str, name: str, kind: str, start: Any, end: Any, nbytes: int) -> None:
        if self._spans is not None:
            raise RuntimeError("this timeline is closed: attach a new one to record more")
        if len(self._pending) >= self._max:
            self.dropped += 1
            return
        self._pending.append((lane, name, kind, start, end, nbytes))

    def _instant(self, instant: Instant) -> None:
        if len(self._instants) >= self._max:
            self.dropped += 1
            return
        self._instants.append(instant)


def _lane_key(lane: str) -> int:
    number = lane[len(COPY_LANE) :].strip()
    return int(number) if number else 1
