"""Conformance: streams are FIFO queues, ``wait_stream`` orders them, ``use_stream`` selects one.

With chaos mode on (where the backend has it) every queued task is delayed at random and copy
destinations are poisoned until the copy has run, so a missing ordering shows as wrong values.
"""

from __future__ import annotations

import torch

from offload_core.testing import kit

N = 32  # iterations; each checks an exact value
SIZE = 256  # elements per copy


def test_stream_runs_work_in_fifo_order(backend):
    """Many copies into one device buffer on one stream, each followed by a read-back on the same
    stream: every read-back sees exactly the copy just before it, and the last copy wins."""
    s = backend.new_stream()
    srcs = [kit.host(backend, kit.pattern(i, SIZE)) for i in range(N)]
    outs = [backend.empty_pinned(SIZE, torch.float32) for _ in range(N)]
    dev = backend.empty_device(SIZE, torch.float32)
    for src, out in zip(srcs, outs):
        backend.copy_async(dev, src, s)
        backend.copy_async(out, dev, s)
    s.synchronize()
    assert s.query()
    assert kit.mismatches(outs, lambda i: kit.pattern(i, SIZE)) == []
    assert torch.equal(kit.download(backend, dev), kit.pattern(N - 1, SIZE))


def test_wait_stream_orders_a_consumer_after_a_producer(backend):
    """The consumer stream copies each buffer back only after ``wait_stream`` on the producer.

    The producer also moves ballast each iteration, so it runs behind the consumer: without a
    working wait the consumer reads buffers that are not written yet."""
    producer, consumer = backend.new_stream(), backend.new_stream()
    ballast_src = backend.empty_pinned(64 << 10)
    ballast_dst = backend.empty_device(64 << 10)
    srcs = [kit.host(backend, kit.pattern(i, SIZE)) for i in range(N)]
    devs = [backend.empty_device(SIZE, torch.float32) for _ in range(N)]
    outs = [backend.empty_pinned(SIZE, torch.float32) for _ in range(N)]
    for src, dev, out in zip(srcs, devs, outs):
        backend.copy_async(ballast_dst, ballast_src, producer)
        backend.copy_async(dev, src, producer)
        backend.wait_stream(consumer, producer)
        backend.copy_async(out, dev, consumer)
    backend.synchronize()
    assert kit.mismatches(outs, lambda i: kit.pattern(i, SIZE)) == []


def test_wait_stream_orders_compute_on_the_current_stream(backend):
    """Compute issued after ``wait_stream(current, side)`` sees the side stream's copy."""
    kit.check_compute_sees_side_copy(backend, lambda side: backend.wait_stream(backend.current_stream(), side))


def test_synchronize_waits_for_every_stream(backend):
    """``backend.synchronize()`` returns only once all streams' work has run."""
    streams = [backend.new_stream() for _ in range(3)]
    srcs = [kit.host(backend, kit.pattern(i, SIZE)) for i in range(len(streams))]
    devs = [backend.empty_device(SIZE, torch.float32) for _ in streams]
    outs = [backend.empty_pinned(SIZE, torch.float32) for _ in streams]
    for s, src, dev, out in zip(streams, srcs, devs, outs):
        backend.copy_async(dev, src, s)
        backend.copy_async(out, dev, s)
    backend.synchronize()
    assert all(s.query() for s in streams)
    assert kit.mismatches(outs, lambda i: kit.pattern(i, SIZE)) == []


def test_use_stream_selects_and_restores_the_current_stream(backend):
    """``use_stream`` nests and restores, and work defaulting to the current stream lands there."""
    default = backend.current_stream()
    a, b = backend.new_stream(), backend.new_stream()
    with backend.use_stream(a) as entered:
        assert entered == a
        assert backend.current_stream() == a
        with backend.use_stream(b):
            assert backend.current_stream() == b
        assert backend.current_stream() == a
    assert backend.current_stream() == default

    src = kit.host(backend, kit.pattern(5, SIZE))
    dev = backend.empty_device(SIZE, torch.float32)
    out = backend.empty_pinned(SIZE, torch.float32)
    with backend.use_stream(a):
        backend.copy_async(dev, src)  # stream=None: the current stream, a
        backend.copy_async(out, dev)
    a.synchronize()
    assert torch.equal(out, kit.pattern(5, SIZE))
