"""How much of the host-to-device copy time a run hid behind compute, read from a stream timeline.

Offloading is free only when every weight copy runs while the device is busy computing; the moment
the host has to stop and wait for a copy, the transfer is on the critical path. A backend with
:data:`offload_core.Capability.TRACE` records both sides of that race as spans (the fake backend's
``timeline.spans()``): copies named ``"H2D"`` on the streams that ran them, and host-blocking waits
named ``"wait <stream>"`` on the ``"default"`` stream. Only these names and fields are relied on,
so any backend that records spans the same way gets the same figure.

The measure::

    copy    = union of the H2D span intervals (overlapping copies on two streams count once)
    exposed = the part of ``copy`` during which the host was blocked: inside a host wait span,
              or inside a copy issued on the default stream (the host runs it itself)
    overlap = 1 - exposed / copy          (None when there was no copy to hide)

Unions, not sums, because two copy streams busy at the same instant cost the run that instant
once; and the host waits are intersected with the copies because a host wait may also be for
other queued work (an event after compute on a side stream), which is not copy time.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol, Sequence

COPY_NAME = "H2D"
HOST_STREAM = "default"
HOST_WAIT_PREFIX = "wait "

Interval = tuple[int, int]


class SpanLike(Protocol):
    stream: str
    name: str
    start_ns: int
    end_ns: int


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Copy time and the part of it the host waited for, in nanoseconds."""

    copy_ns: int
    exposed_ns: int

    @property
    def fraction(self) -> float | None:
        """Share of copy time hidden behind compute, 0..1; None without copies (nothing to hide)."""
        if self.copy_ns <= 0:
            return None
        return 1.0 - self.exposed_ns / self.copy_ns


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering exactly the given ones (empty intervals dropped)."""
    merged: list[list[int]] = []
    for start, end in sorted(i for i in intervals if i[1] > i[0]):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def length(intervals: Sequence[Interval]) -> int:
    """Total length of disjoint intervals."""
    return sum(end - start for start, end in intervals)


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The intersection of two sorted, disjoint interval lists (a two-pointer sweep)."""
    out: list[Interval] = []
    i = j = 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def copy_overlap(spans: Iterable[SpanLike]) -> Overlap:
    """Measure copy time and its exposed part over ``spans`` (see the module docstring)."""
    copies: list[Interval] = []
    blocked: list[Interval] = []
    for span in spans:
        interval = (span.start_ns, span.end_ns)
        if span.name == COPY_NAME:
            copies.append(interval)
            if span.stream == HOST_STREAM:
                blocked.append(interval)
        elif span.stream == HOST_STREAM and span.name.startswith(HOST_WAIT_PREFIX):
            blocked.append(interval)
    copy = union(copies)
    exposed = intersect(copy, union(blocked))
    return Overlap(copy_ns=length(copy), exposed_ns=length(exposed))
