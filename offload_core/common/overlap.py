"""How much of the host-to-device copy time a run hid behind compute, read from a timeline.

Offloading is free only when every weight copy runs while the device is busy computing; the moment
compute has to stop and wait for a copy, the transfer is on the critical path, and a copy that
runs while the device has nothing to compute (a model-level group loaded while the host encodes
the prompt) hides behind nothing either. The strategies record both sides of that race in a
:class:`~offload_core.common.timeline.Timeline`: ``copy`` spans (the transfers loading a block or group,
on the copy lanes), ``compute`` spans (a block, or a model-level group while it is active) and
``wait`` spans (the compute stream held until a copy was done), plus host waits (instants with a
duration: the host blocked on device work). Only those kinds are relied on, so the figure means
the same on every backend.

The measure::

    copy    = union of the copy spans (overlapping copies on two lanes count once)
    busy    = union of the compute spans, less the waits and host waits
    hidden  = the part of ``copy`` that lies inside ``busy``
    overlap = hidden / copy               (None when there was no copy to hide)

Unions, not sums, because two copy streams busy at the same instant cost the run that instant
once. A copy is hidden only where a compute span ran beside it: not where compute waited for it,
the host was blocked, or nothing computed at all. Compute outside any span (a layerwise model's
work between its blocks) is not seen, so the figure errs low, never high.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

from .timeline import Instant, Span

Interval = tuple[int, int]


@dataclasses.dataclass(frozen=True)
class Overlap:
    """Copy time and the part of it not hidden behind compute (compute waited for it, the host
    was blocked, or nothing computed), in nanoseconds."""

    copy_ns: int
    exposed_ns: int  # not hidden: ``waited_ns`` and the copy time while nothing computed
    waited_ns: int = 0  # the part compute (or the host) waited for

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


def difference(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """``a`` less ``b``, both sorted and disjoint."""
    out: list[Interval] = []
    j = 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while start < end and k < len(b) and b[k][0] < end:
            if b[k][0] > start:
                out.append((start, b[k][0]))
            start = max(start, b[k][1])
            k += 1
        if start < end:
            out.append((start, end))
    return out


def copy_overlap(spans: Iterable[Span], instants: Iterable[Instant] = ()) -> Overlap:
    """Measure copy time and the part of it not hidden behind compute, over a timeline's spans
    and instants."""
    copies: list[Interval] = []
    computing: list[Interval] = []
    blocked: list[Interval] = []
    for span in spans:
        if span.kind == "copy":
            copies.append((span.start_ns, span.end_ns))
        elif span.kind == "compute":
            computing.append((span.start_ns, span.end_ns))
        elif span.kind == "wait":
            blocked.append((span.start_ns, span.end_ns))
    blocked += [(i.at_ns, i.at_ns + i.duration_ns) for i in instants if i.kind == "host wait"]
    copy, held = union(copies), union(blocked)
    hidden = intersect(copy, difference(union(computing), held))
    return Overlap(copy_ns=length(copy), exposed_ns=length(copy) - length(hidden),
                   waited_ns=length(intersect(copy, held)))


def timeline_overlap(timeline) -> Overlap | None:
    """:func:`copy_overlap` of a closed :class:`~offload_core.common.timeline.Timeline`; None when its
    times are host times (the backend offers no device timing), which say when copies were issued,
    not when they ran."""
    if not timeline.device_timed:
        return None
    return copy_overlap(timeline.spans(), timeline.instants())
