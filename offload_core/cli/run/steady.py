"""``offload-core run``'s headline figures as a steady state with its range, and whether the run
can vouch for them.

One call's overlap or cost ratio moves from run to run on a shared machine (a copy thread not
scheduled for a few milliseconds is a copy compute waits for), so the report gives each timed
figure per denoising step, over the steps after the first (the first pays the first loads), as
their median and their range, and calls the figures "unreliable (machine busy)" (the phrase
``offload-core bench`` uses, :data:`offload_core.bench.UNRELIABLE`) when the machine had more
runnable work than cores when the call began, when the steps disagree by more than
:data:`WIDE_WAITED` or :data:`WIDE_STEP`, or when the call without offload came out faster than
the offloaded one by more than its spread (:func:`offload_core.bench.status` with the floor 1).

The steps' agreement is judged on what a busy machine moves: the share of copy time compute
waited for (a copy thread not scheduled is a copy compute waits for) and the step times. The
share hidden behind compute is reported with its range but not judged: it also counts copy time
while nothing computed, which on a simulator (whose compute is the host thread) is the host's own
work between blocks, and moves with where a copy lands against a block's edge.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any, Sequence

from ...bench import BASELINE, UNRELIABLE, status
from ...bench.timing import ratio
from ...common.overlap import Overlap, copy_overlap
from ...common.timeline import Timeline

#: steps whose shares of copy time compute waited for span more than this (0..1) disagree too much
WIDE_WAITED = 0.10
#: steps whose times span more than this share of their median disagree too much to vouch for
WIDE_STEP = 0.5


@dataclasses.dataclass(frozen=True)
class Steady:
    """A figure over the steps after the first: the median and the range."""

    median: float
    low: float
    high: float
    first_step: int  # 1-based number of the first step it covers (2)
    last_step: int

    @classmethod
    def of(cls, values: Sequence[float | None], first_step: int = 2) -> Steady | None:
        """The steady state of per-step ``values`` (the first step's left out), None without two
        steps to compare; steps without a value (no copy to hide) are skipped."""
        later = [v for v in values[first_step - 1:] if v is not None]
        if len(later) < 2:
            return None
        return cls(statistics.median(later), min(later), max(later), first_step, len(values))

    @property
    def steps(self) -> str:
        return f"steps {self.first_step}-{self.last_step}"

    def to_dict(self) -> dict[str, Any]:
        return {"median": self.median, "low": self.low, "high": self.high, "steps": [self.first_step, self.last_step]}


def step_overlaps(timeline: Timeline | None, loop_start_ms: float | None,
                  step_ends_ms: Sequence[float]) -> list[Overlap]:
    """Each step's copy time and the part of it hidden behind compute (:func:`copy_overlap` of
    the spans clipped to the step, between the host's marks of its start and end); empty when the
    timeline holds host times or the steps were not timed."""
    if timeline is None or not timeline.device_timed or loop_start_ms is None or not step_ends_ms:
        return []
    bounds = [round(t * 1e6) for t in (loop_start_ms, *step_ends_ms)]
    spans = timeline.spans()
    waits = [i for i in timeline.instants() if i.kind == "host wait"]
    figures = []
    for start, end in zip(bounds, bounds[1:]):  # each span and host wait clipped to the step
        parts = [dataclasses.replace(s, start_ns=max(s.start_ns, start), end_ns=min(s.end_ns, end)) for s in spans
                 if s.start_ns < end and s.end_ns > start]
        blocked = [dataclasses.replace(i, at_ns=max(i.at_ns, start),
                                       duration_ns=min(i.at_ns + i.duration_ns, end) - max(i.at_ns, start))
                   for i in waits if i.at_ns < end and i.at_ns + i.duration_ns > start]
        figures.append(copy_overlap(parts, blocked))
    return figures


def waited_share(overlap: Overlap) -> float | None:
    """The share of ``overlap``'s copy time compute (or the host) waited for; None without copies."""
    return overlap.waited_ns / overlap.copy_ns if overlap.copy_ns > 0 else None


def busy_machine() -> str | None:
    """Why the machine is too busy to time on ("load average 7.41 on 2 cores"), or None."""
    if not hasattr(os, "getloadavg"):
        return None
    load, cores = os.getloadavg()[0], os.cpu_count() or 1
    return f"load average {load:.2f} on {cores} cores" if load > cores else None


def compare_ratio(offloaded_steps: Sequence[float], resident_steps: Sequence[float]) -> tuple[float, float] | None:
    """(median, spread) of the offloaded step time over the resident one, step by step after the
    first (the same steps of the same call), as ``offload-core bench`` takes its ratios."""
    if len(offloaded_steps) != len(resident_steps) or len(offloaded_steps) < 3:
        return None
    return ratio(list(offloaded_steps[1:]), list(resident_steps[1:]))


def unreliable_reasons(busy: str | None, waited: Steady | None, step: Steady | None,
                       compare: tuple[float, float] | None) -> list[str]:
    """What stops the run from vouching for its timed figures (empty: nothing). ``waited``: the
    share of copy time compute waited for, per step."""
    reasons = [busy] if busy else []
    if waited is not None and waited.high - waited.low > WIDE_WAITED:
        reasons.append(f"the share of copy time compute waited for ranges over {(waited.high - waited.low) * 100:.0f} "
                       f"points across {waited.steps}")
    if step is not None and step.median > 0 and (step.high - step.low) / step.median > WIDE_STEP:
        reasons.append(f"the step times range over {(step.high - step.low) / step.median:.0%} of their median")
    if compare is not None and status(compare[0], compare[1], None, floor=1.0) == BASELINE:
        reasons.append(f"the offloaded steps came out faster than those without offload ({compare[0]:.2f}x, "
                       "beyond its spread)")
    return reasons


__all__ = ["UNRELIABLE", "Steady", "busy_machine", "compare_ratio", "step_overlaps", "unreliable_reasons",
           "waited_share"]
