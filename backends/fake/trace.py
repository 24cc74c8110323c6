"""Per-stream timeline of the fake device, exportable as Chrome trace JSON (opens in Perfetto).

Spans are recorded by the thread that runs the work, so the timeline shows real overlap between
the copy streams and the host thread that plays the default (compute) stream.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Iterable


@dataclasses.dataclass(frozen=True)
class Span:
    stream: str
    name: str
    start_ns: int
    end_ns: int
    nbytes: int = 0

    @property
    def seconds(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class StreamTrace:
    """What the fake device's streams ran, as the device itself would see it (what the strategies
    meant by it is :class:`offload_core.common.timeline.Timeline`, which they record themselves).

    Bounded list of spans, appended to from every stream's thread. ``max_spans`` keeps long
    runs from growing memory. Appends are plain tuples (list.append is atomic), because they sit on
    every stream operation's path."""

    def __init__(self, max_spans: int = 200_000) -> None:
        self._spans: list[tuple[str, str, int, int, int]] = []
        self._max = max_spans
        self.dropped = 0

    def add(self, stream: str, name: str, start_ns: int, end_ns: int, nbytes: int = 0) -> None:
        if len(self._spans) >= self._max:
            self.dropped += 1
            return
        self._spans.append((stream, name, start_ns, end_ns, nbytes))

    def spans(self) -> list[Span]:
        return [Span(*s) for s in list(self._spans)]

    def clear(self) -> None:
        self._spans = []
        self.dropped = 0

    def chrome_trace(self) -> dict[str, Any]:
        """The timeline in the Trace Event Format: one thread row per stream."""
        return chrome_trace(self.spans())

    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.chrome_trace(), f)


def chrome_trace(spans: Iterable[Span]) -> dict[str, Any]:
    spans = list(spans)
    rows = {name: i for i, name in enumerate(dict.fromkeys(s.stream for s in spans))}
    events: list[dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": stream}}
        for stream, tid in rows.items()
    ]
    for s in spans:
        event = {
            "name": s.name,
            "ph": "X",
            "pid": 0,
            "tid": rows[s.stream],
            "ts": s.start_ns / 1e3,
            "dur": (s.end_ns - s.start_ns) / 1e3,
        }
        if s.nbytes:
            event["args"] = {"bytes": s.nbytes}
        events.append(event)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


now_ns = time.perf_counter_ns
