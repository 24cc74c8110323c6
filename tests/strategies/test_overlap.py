"""``offload_core.common.overlap``: copy time hidden behind compute, on hand-made timelines whose answer
can be worked out on paper (times in nanoseconds). A copy is hidden only where a compute span ran
beside it and neither compute nor the host waited."""

from __future__ import annotations

import random

import pytest

from offload_core.common.overlap import Overlap, copy_overlap, difference, intersect, length, union
from offload_core.common.timeline import Instant, Span


def copy(start, end, lane="copy"):
    return Span(lane, "load block", "copy", start, end)


def wait(start, end):
    return Span("compute", "wait block", "wait", start, end)


def compute(start, end):
    return Span("compute", "block", "compute", start, end)


def test_no_copies_means_nothing_to_hide():
    result = copy_overlap([wait(0, 10), compute(10, 20)])
    assert result == Overlap(0, 0) and result.fraction is None


def test_copies_compute_never_waited_for_are_fully_hidden():
    assert copy_overlap([copy(0, 10), copy(20, 30), compute(0, 30)]).fraction == 1.0


def test_a_wait_covering_a_whole_copy_exposes_all_of_it():
    assert copy_overlap([copy(10, 20), wait(5, 25)]).fraction == 0.0


def test_partly_exposed_copy():
    # copy 0..100 beside compute 0..75; compute waits 75..110 for its tail: a quarter exposed
    result = copy_overlap([copy(0, 100), compute(0, 75), wait(75, 110)])
    assert (result.copy_ns, result.exposed_ns, result.waited_ns) == (100, 25, 25)
    assert result.fraction == pytest.approx(0.75)


def test_concurrent_copies_on_two_lanes_count_once():
    # one lane busy 0..60, the other 40..100: the link is busy 0..100, not 120
    spans = [copy(0, 60), copy(40, 100, "copy 2"), compute(0, 50), wait(50, 70), compute(70, 100)]
    result = copy_overlap(spans)
    assert (result.copy_ns, result.exposed_ns) == (100, 20)


def test_waiting_longer_than_the_copy_is_not_exposed_copy_time():
    # compute waits 100..200, but the copy ended at 50 (the wait was for older queued work)
    assert copy_overlap([copy(0, 50), compute(0, 100), wait(100, 200)]).fraction == 1.0


def test_compute_spans_do_not_expose_copies():
    assert copy_overlap([copy(0, 100), compute(0, 100)]).fraction == 1.0


def test_a_copy_while_nothing_computes_hides_behind_nothing():
    """A first model-level call: the group's copy runs while the host prepares its inputs, and
    compute starts once it landed, with no wait span in between: none of it is hidden."""
    assert copy_overlap([copy(0, 10), compute(12, 30)]) == Overlap(copy_ns=10, exposed_ns=10, waited_ns=0)
    # half of a copy beside the end of a compute span, half in the idle gap after it
    assert copy_overlap([compute(0, 50), copy(40, 60), compute(70, 90)]).fraction == 0.5


def test_a_host_wait_during_a_copy_is_exposed():
    # the host blocked 25..75 (an instant with its duration) while the copy ran 0..100
    host = Instant("host", "unload vae (still loading)", "host wait", 25, 50)
    miss = Instant("compute", "prefetch miss block", "prefetch miss", 0, 0)
    result = copy_overlap([copy(0, 100), compute(0, 100)], [host, miss])
    assert (result.copy_ns, result.exposed_ns) == (100, 50)


def test_overlapping_waits_are_not_double_counted():
    result = copy_overlap([copy(0, 100), compute(0, 10), wait(10, 60), wait(40, 80), compute(80, 100)])
    assert result.exposed_ns == result.waited_ns == 70


def test_empty_and_inverted_spans_are_ignored():
    assert copy_overlap([copy(5, 5), copy(9, 3)]) == Overlap(0, 0)


def _covered(intervals, t):
    return any(s <= t < e for s, e in intervals)


@pytest.mark.parametrize("seed", range(20))
def test_interval_helpers_agree_with_a_pointwise_count(seed):
    """union/intersect/difference against the definition: which integer instants are covered."""
    rng = random.Random(seed)

    def random_intervals():
        out = []
        for _ in range(rng.randint(0, 6)):
            start = rng.randint(0, 50)
            out.append((start, start + rng.randint(0, 15)))
        return out

    a, b = random_intervals(), random_intervals()
    ua, ub = union(a), union(b)
    both = intersect(ua, ub)
    instants = range(0, 70)
    assert length(ua) == sum(_covered(a, t) for t in instants)
    assert length(both) == sum(_covered(a, t) and _covered(b, t) for t in instants)
    assert length(difference(ua, ub)) == sum(_covered(a, t) and not _covered(b, t) for t in instants)
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(ua, ua[1:]))  # sorted, disjoint, merged
