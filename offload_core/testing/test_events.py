"""Conformance: events order work across streams, and report and wait for their point.

These are the orderings the layerwise strategy depends on: a block's weights are read only after
their copy's event, and a slot is overwritten only after the compute that read it.
"""

from __future__ import annotations

import pytest
import torch

from offload_core.testing import kit

N = 32
SIZE = 256


@pytest.fixture
def slow(backend_name, backend):
    """Work that keeps a stream busy for a while (see :class:`kit.SlowWork`)."""
    with kit.slow_backend(backend_name, backend) as work:
        yield work


def test_event_orders_a_consumer_after_a_producer(backend):
    """Producer: ballast + copy in, record. Consumer: wait the event, copy out. Every result
    exact over many iterations; the ballast keeps the producer behind, so a wait that does not
    wait is caught on nearly every iteration."""
    producer, consumer = backend.new_stream(), backend.new_stream()
    ballast_src = backend.empty_pinned(64 << 10)
    ballast_dst = backend.empty_device(64 << 10)
    srcs = [kit.host(backend, kit.pattern(i, SIZE)) for i in range(N)]
    devs = [backend.empty_device(SIZE, torch.float32) for _ in range(N)]
    outs = [backend.empty_pinned(SIZE, torch.float32) for _ in range(N)]
    events = []
    for src, dev, out in zip(srcs, devs, outs):
        backend.copy_async(ballast_dst, ballast_src, producer)
        backend.copy_async(dev, src, producer)
        ready = backend.new_event()
        ready.record(producer)
        ready.wait(consumer)
        backend.copy_async(out, dev, consumer)
        events.append(ready)
    backend.synchronize()
    assert all(e.query() for e in events)
    assert kit.mismatches(outs, lambda i: kit.pattern(i, SIZE)) == []


def test_events_protect_reused_slots(backend):
    """Two device slots reused in turn, with two events per slot re-recorded every iteration (the
    layerwise pattern): the producer overwrites a slot only after the consumer's read of it
    (``free``), the consumer reads only after the producer's write (``ready``)."""
    producer, consumer = backend.new_stream(), backend.new_stream()
    slots = [backend.empty_device(SIZE, torch.float32) for _ in range(2)]
    ready = [backend.new_event() for _ in range(2)]
    free = [backend.new_event() for _ in range(2)]
    srcs = [kit.host(backend, kit.pattern(i, SIZE)) for i in range(N)]
    outs = [backend.empty_pinned(SIZE, torch.float32) for _ in range(N)]
    for i in range(N):
        k = i % 2
        free[k].wait(producer)  # unrecorded on the first use of each slot: no wait
        backend.copy_async(slots[k], srcs[i], producer)
        ready[k].record(producer)
        ready[k].wait(consumer)
        backend.copy_async(outs[i], slots[k], consumer)
        free[k].record(consumer)
    backend.synchronize()
    assert kit.mismatches(outs, lambda i: kit.pattern(i, SIZE)) == []


def test_event_wait_orders_compute_on_the_current_stream(backend):
    """``event.wait()`` with no stream orders the current stream: compute after it sees the copy."""

    def order(side):
        done = backend.new_event()
        done.record(side)
        done.wait()

    kit.check_compute_sees_side_copy(backend, order)


def test_query_is_false_until_synchronize_returns(slow):
    """``query()`` of an event (and its stream) behind slow work is False, never blocks; after
    ``event.synchronize()`` it is True and the work's results are visible on the host."""
    b = slow.backend
    s = b.new_stream()
    src = kit.host(b, kit.pattern(1, SIZE))
    dev = b.empty_device(SIZE, torch.float32)
    out = b.empty_pinned(SIZE, torch.float32)
    slow.enqueue(s)
    b.copy_async(dev, src, s)
    b.copy_async(out, dev, s)
    done = b.new_event()
    done.record(s)
    assert not done.query()
    assert not s.query()
    done.synchronize()
    assert done.query()
    assert torch.equal(out, kit.pattern(1, SIZE))


def test_unrecorded_event_does_not_wait(backend):
    """Waiting on an event that was never recorded does not wait (the first use of a slot's
    ``free`` event relies on it): query is True, synchronize returns, a stream behind it runs."""
    never = backend.new_event()
    assert never.query()
    assert kit.finishes_within(never.synchronize)
    s = backend.new_stream()
    never.wait(s)
    never.wait()
    src = kit.host(backend, kit.pattern(2, SIZE))
    dev = backend.empty_device(SIZE, torch.float32)
    out = backend.empty_pinned(SIZE, torch.float32)
    backend.copy_async(dev, src, s)
    backend.copy_async(out, dev, s)
    assert kit.finishes_within(s.synchronize), "a stream waiting on an unrecorded event hung"
    assert torch.equal(out, kit.pattern(2, SIZE))


def test_rerecording_moves_the_marker_for_later_waits_only(slow):
    """A wait enqueued before the event is recorded again keeps waiting for the old point: the
    consumer finishes while the producer's later, slow work is still running."""
    b = slow.backend
    producer, consumer = b.new_stream(), b.new_stream()
    src = kit.host(b, kit.pattern(3, SIZE))
    dev = b.empty_device(SIZE, torch.float32)
    out = b.empty_pinned(SIZE, torch.float32)
    marker = b.new_event()
    b.copy_async(dev, src, producer)
    marker.record(producer)
    marker.wait(consumer)
    b.copy_async(out, dev, consumer)
    slow.enqueue(producer)
    marker.record(producer)  # moved behind the slow work
    consumer.synchronize()
    assert torch.equal(out, kit.pattern(3, SIZE))
    assert not producer.query(), "the consumer's earlier wait followed the event's new record"
    assert not marker.query()
    marker.synchronize()
    assert marker.query() and producer.query()


def test_an_overwrite_waits_for_an_earlier_read_on_another_stream(backend):
    """Write-after-read: a copy into a buffer that waits (``free``) for a read of the buffer on
    another stream must leave the read's data alone, even when the read is still queued when the
    overwrite is enqueued. This is how a layerwise slot or a gather buffer is recycled."""
    producer, consumer = backend.new_stream(), backend.new_stream()
    slot = backend.empty_device(SIZE, torch.float32)
    out = backend.empty_pinned(SIZE, torch.float32)
    ready, free = backend.new_event(), backend.new_event()
    for i in range(8):
        first = kit.host(backend, kit.pattern(2 * i, SIZE))
        second = kit.host(backend, kit.pattern(2 * i + 1, SIZE))
        backend.copy_async(slot, first, producer)
        ready.record(producer)
        ready.wait(consumer)
        backend.copy_async(out, slot, consumer)
        free.record(consumer)
        ready.synchronize()  # the slot holds `first`; the consumer's read is due, maybe not done
        free.wait(producer)
        backend.copy_async(slot, second, producer)
        backend.synchronize()
        assert torch.equal(out, kit.pattern(2 * i, SIZE)), f"iteration {i}: the read saw the overwrite"
        assert torch.equal(kit.download(backend, slot), kit.pattern(2 * i + 1, SIZE))
