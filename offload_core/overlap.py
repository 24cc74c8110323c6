"""How much of the host-to-device copy time a run hid behind compute, read from a timeline.

Offloading is free only when every weight copy runs while the device is busy computing; the moment
compute has to stop and wait for a copy, the transfer is on the critical path. The strategies
record both sides of that race in a :class:`~offload_core.timeline.Timeline`: ``copy`` spans (the
transfers loading a block or group, on the copy lanes) and ``wait`` spans (the compute stream held
until a copy was done), plus host waits (instants with a duration: the host blocked on device
work). Only those kinds are relied on, so the figure means the same on every backend.

The measure::

    copy    = union of the copy spans (overlapping copies on two lanes count once)
    exposed = the part of ``copy`` during which compute waited for a copy or the host was blocked
    overlap = 1 - exposed / copy          (None when there was no copy to hide)

Unions, not sums, because two copy streams busy at the same instant cost the run that instant
once; and the waits are intersected with the copies because a wait may outlast the copy it was
for (it also waits for the work queued before the copy), which is not copy time.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol, Sequence

Interval = tuple[int, int]


class SpanLike(Protocol):
    kind: str
    start_ns: int
    end_ns: int


class InstantLike(Protocol):
    kind: str
    at_ns: int
    duration_ns: int


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Copy time and the part of it compute (or the host) waited for, in nanoseconds."""

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


def copy_overlap(spans: Iterable[SpanLike], instants: Iterable[InstantLike] = ()) -> Overlap:
    """Measure copy time and its exposed part over a timeline's spans and instants."""
    copies: list[Interval] = []
    blocked: list[Interval] = []
    for span in spans:
        if span.kind == "copy":
            copies.append((span.start_ns, span.end_ns))
        elif span.kind == "wait":
            blocked.append((span.start_ns, span.end_ns))
    blocked += [(i.at_ns, i.at_ns + i.duration_ns) for i in instants if i.kind == "host wait"]
    copy = union(copies)
    exposed = intersect(copy, union(blocked))
    return Overlap(copy_ns=length(copy), exposed_ns=length(exposed))


def timeline_overlap(timeline) -> Overlap | None:
    """:func:`copy_overlap` of a closed :class:`~offload_core.timeline.Timeline`; None when its
    times are host times (the backend offers no device timing), which say when copies were issued,
    not when they ran."""
    if not timeline.device_timed:
        return None
    return copy_overlap(timeline.spans(), timeline.instants())
