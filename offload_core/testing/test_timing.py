"""Conformance, for backends with ``Capability.TIMING``: events made with ``new_event(timing=True)``
measure time on the device, where the work runs, not on the host that queued it. Traces rely on
it (``handle.trace()`` places every span edge through ``elapsed_time``)."""

from __future__ import annotations

import time

import pytest

from offload_core import Capability
from offload_core.testing import SimulatorCapability
from offload_core.testing import kit


@pytest.fixture(autouse=True)
def _needs_timing(backend):
    if Capability.TIMING not in type(backend).capabilities:
        pytest.skip("the backend does not list Capability.TIMING")


def test_elapsed_time_spans_the_work_between_two_events(backend, backend_name):
    """Events around slow work on a side stream: the time between them covers the work, although
    the host queued all three calls at once; an event later on the stream is not earlier."""
    with kit.slow_backend(backend_name, backend) as slow:
        b = slow.backend
        stream = b.new_stream()
        start, end, later = (b.new_event(timing=True) for _ in range(3))
        queued = time.perf_counter()
        start.record(stream)
        slow.enqueue(stream)
        end.record(stream)
        later.record(stream)
        queued = time.perf_counter() - queued
        end.synchronize()
        later.synchronize()
        took = start.elapsed_time(end) / 1e3
        assert took >= 0 and start.elapsed_time(later) >= start.elapsed_time(end)
        if SimulatorCapability.BANDWIDTH in type(backend).capabilities:
            assert took >= 0.9 * kit.SLOW_SECONDS, f"the events measured {took:.3f} s of a {kit.SLOW_SECONDS} s copy"
        else:  # a big copy: the link is busy far longer than the host takes to queue it
            assert took > queued, "the events timed the host's queueing, not the work"


def test_events_on_two_streams_share_one_clock(backend):
    """A reference event on the current stream and an event on a side stream recorded after it
    (ordered by a wait): the side event is not before the reference."""
    ref, side = backend.new_event(timing=True), backend.new_event(timing=True)
    stream = backend.new_stream()
    ref.record(backend.current_stream())
    ref.wait(stream)
    side.record(stream)
    side.synchronize()
    assert ref.elapsed_time(side) >= 0
