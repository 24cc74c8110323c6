"""The device at its fullest in one phase of a call, by the planner's rules: what the components
hold, what a running one adds, and model-level's prefetch of the next group. Plain arithmetic over
byte counts, shared by the planner's search (:mod:`.planner`) and a plan re-priced with measured
activations (:meth:`.plan.Plan.measured`)."""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

#: model-level offload prefetches the next group only with this share of the device (of the budget)
#: left free beside both groups, or the active group's activations if more
PREFETCH_RESERVE = 0.1


def phase_peak(holders: Iterable[tuple[str, int, int, bool]], running: Iterable[str]) -> int:
    """The device at its fullest in a phase whose components are ``running``: what every holder
    keeps then (the running ones, and those that do not park), plus the most any one running
    component adds: components run one at a time. ``holders``: ``(name, held, transient, parks)``
    per component, ``transient`` being what it adds while it runs (its activations, and its
    weights when it is loaded around its use)."""
    running = set(running)
    held = transient = 0
    for name, holds, adds, parks in holders:
        if name in running:
            held += holds
            transient = max(transient, adds)
        elif not parks:
            held += holds
    return held + transient


def group_peak(sizes: Mapping[str, tuple[int, int]], groups: Sequence[Sequence[str]], running: Iterable[str],
               budget: int | None = None) -> int:
    """Model-level in a phase whose components are ``running``: the group of each running component
    in turn, with its activations,
    and the next group (in ``groups``' order) beside it where model-level offload would prefetch it:
    within ``budget``, with :data:`PREFETCH_RESERVE` of it (or the group's activations) left free.
    ``sizes``: name -> (weights, activations)."""
    running = set(running)
    peak = 0
    for k, group in enumerate(groups):
        if not running & set(group):
            continue
        weights, activations = sum(sizes[n][0] for n in group), max(sizes[n][1] for n in group)
        peak = max(peak, weights + activations)
        if budget is not None and k + 1 < len(groups):
            following = sum(sizes[n][0] for n in groups[k + 1])
            if weights + following + max(PREFETCH_RESERVE * budget, activations) <= budget:
                peak = max(peak, weights + following + activations)
    return peak
