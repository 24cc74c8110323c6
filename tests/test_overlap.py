"""``offload_core.overlap``: copy time hidden behind compute, on hand-made timelines whose answer
can be worked out on paper (times in nanoseconds)."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from offload_core.overlap import Overlap, copy_overlap, intersect, length, union


@dataclass(frozen=True)
class S:
    stream: str
    name: str
    start_ns: int
    end_ns: int


def h2d(start, end, stream="stream-1"):
    return S(stream, "H2D", start, end)


def host_wait(start, end, on="stream-1"):
    return S("default", f"wait {on}", start, end)


def test_no_copies_means_nothing_to_hide():
    result = copy_overlap([host_wait(0, 10), S("stream-1", "wait default", 0, 5)])
    assert result == Overlap(0, 0) and result.fraction is None


def test_copies_the_host_never_waited_for_are_fully_hidden():
    assert copy_overlap([h2d(0, 10), h2d(20, 30)]).fraction == 1.0


def test_a_wait_covering_a_whole_copy_exposes_all_of_it():
    assert copy_overlap([h2d(10, 20), host_wait(5, 25)]).fraction == 0.0


def test_partly_exposed_copy():
    # copy 0..100; the host blocks 75..100 for its tail: a quarter exposed
    result = copy_overlap([h2d(0, 100), host_wait(75, 110)])
    assert (result.copy_ns, result.exposed_ns) == (100, 25)
    assert result.fraction == pytest.approx(0.75)


def test_concurrent_copies_on_two_streams_count_once():
    # stream-1 busy 0..60, stream-2 busy 40..100: the link is busy 0..100, not 120
    spans = [h2d(0, 60), h2d(40, 100, "stream-2"), host_wait(50, 70, on="stream-2")]
    result = copy_overlap(spans)
    assert (result.copy_ns, result.exposed_ns) == (100, 20)


def test_waiting_for_something_other_than_a_copy_is_not_exposed_copy_time():
    # the host waits 100..200 for a stream that is no longer copying (its copy ended at 50)
    assert copy_overlap([h2d(0, 50), host_wait(100, 200)]).fraction == 1.0


def test_only_host_waits_count_not_waits_queued_on_side_streams():
    # a side stream waiting for compute blocks that stream, not the host
    spans = [h2d(0, 100), S("stream-1", "wait default", 0, 100), S("stream-2", "wait stream-1", 0, 100)]
    assert copy_overlap(spans).fraction == 1.0


def test_compute_spans_on_the_default_stream_do_not_expose_copies():
    spans = [h2d(0, 100), S("default", "all_gather", 0, 100), S("default", "D2H", 0, 100)]
    assert copy_overlap(spans).fraction == 1.0


def test_a_copy_issued_on_the_default_stream_is_all_exposed():
    # the host runs it itself; here it is half the total copy time
    result = copy_overlap([h2d(0, 50), h2d(100, 150, stream="default")])
    assert (result.copy_ns, result.exposed_ns) == (100, 50)


def test_overlapping_waits_are_not_double_counted():
    result = copy_overlap([h2d(0, 100), host_wait(10, 60), host_wait(40, 80, on="stream-2")])
    assert result.exposed_ns == 70


def test_empty_and_inverted_spans_are_ignored():
    assert copy_overlap([h2d(5, 5), h2d(9, 3)]) == Overlap(0, 0)


def _covered(intervals, t):
    return any(s <= t < e for s, e in intervals)


@pytest.mark.parametrize("seed", range(20))
def test_interval_helpers_agree_with_a_pointwise_count(seed):
    """union/intersect against the definition: which integer instants are covered."""
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
    assert all(e1 < s2 for (_, e1), (s2, _) in zip(ua, ua[1:]))  # sorted, disjoint, merged
