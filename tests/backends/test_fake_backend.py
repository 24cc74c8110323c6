"""Behaviour of the fake backend that the conformance kit cannot assume of every backend:
chaos poisoning, the bandwidth model, real overlap, the trace, thread hygiene, options, errors.

Timing assertions use generous margins (this runs on small CI machines); nothing waits by
sleeping: ordering is always established by the API, and sleeps only stand for host compute.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time

import pytest
import torch

from offload_core_fake import FakeBackend, FakeOutOfMemoryError, StreamError

MIB = 1 << 20

pytestmark = pytest.mark.quick  # the fake backend path, in the quick subset (pytest -m quick)


@pytest.fixture
def make():
    """FakeBackend factory; every instance is closed (its stream threads joined) afterwards."""
    made: list[FakeBackend] = []

    def factory(**options) -> FakeBackend:
        made.append(FakeBackend(**options))
        return made[-1]

    yield factory
    for b in made:
        b.close()


def pinned(b: FakeBackend, values: torch.Tensor) -> torch.Tensor:
    t = b.empty_pinned(tuple(values.shape), values.dtype)
    return t.copy_(values)


def stream_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("offload-core-stream-")}


# -- chaos ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, poison",
    [(torch.float32, float("nan")), (torch.bfloat16, float("nan")), (torch.int64, 2**63 - 1), (torch.bool, True)],
)
@pytest.mark.unsanitized("reads the destination before synchronising, on purpose")
def test_chaos_poisons_the_destination_until_the_copy_has_run(make, dtype, poison):
    """Right after ``copy_async`` the destination holds the poison (NaN; integers: their max;
    bool: True), and the right values once the copy's stream has been waited for."""
    b = make(chaos=True, chaos_delay=0.2)  # the copy starts 0.1-0.2 s after it is queued
    values = torch.zeros(64, dtype=dtype)
    src, dst = pinned(b, values), b.empty_device(64, dtype)
    dst.copy_(torch.ones(64, dtype=dtype))
    s = b.new_stream()
    b.copy_async(dst, src, s)
    expected = torch.full((64,), poison, dtype=dtype)
    assert torch.equal(dst, expected) or (dtype.is_floating_point and dst.isnan().all())
    s.synchronize()
    assert torch.equal(dst, values)


@pytest.mark.unsanitized("a read-after-write race on purpose")
def test_a_reader_that_skips_the_wait_sees_poison(make):
    """A consumer stream that copies a buffer out without waiting for the producer's event gets
    NaN, every time; the same consumer with the wait gets the values. (Ballast keeps the producer
    busy for several chaos delays, so the racy read always comes first.)"""
    b = make(chaos=True, chaos_delay=0.02)
    producer, consumer = b.new_stream(), b.new_stream()
    ballast_src, ballast_dst = b.empty_pinned(1024), b.empty_device(1024)
    values = torch.arange(1024, dtype=torch.float32)
    src, dev = pinned(b, values), b.empty_device(1024, torch.float32)
    racy, ordered = b.empty_pinned(1024, torch.float32), b.empty_pinned(1024, torch.float32)
    for _ in range(8):  # >= 8 * 10 ms before the producer's copy runs
        b.copy_async(ballast_dst, ballast_src, producer)
    b.copy_async(dev, src, producer)
    ready = b.new_event()
    ready.record(producer)
    b.copy_async(racy, dev, consumer)  # BUG on purpose: no ready.wait(consumer); runs within 20 ms
    ready.wait(consumer)
    b.copy_async(ordered, dev, consumer)
    b.synchronize()
    assert racy.isnan().all()
    assert torch.equal(ordered, values)


def test_chaos_poison_spares_a_read_ordered_before_the_overwrite(make):
    """Write-after-read: the poison of an overwrite must not reach a buffer that an earlier read,
    which the overwrite waits for, has not consumed yet (a recycled slot)."""
    b = make(chaos=True, chaos_delay=0.02)
    producer, consumer = b.new_stream(), b.new_stream()
    slot = kit_upload(b, torch.full((1024,), 1.0))
    out = b.empty_pinned(1024, torch.float32)
    ballast = [(b.empty_pinned(16), b.empty_device(16)) for _ in range(4)]
    for host, dev in ballast:  # the consumer's read comes after >= 4 * 10 ms
        b.copy_async(host, dev, consumer)
    b.copy_async(out, slot, consumer)
    free = b.new_event()
    free.record(consumer)
    free.wait(producer)
    new = pinned(b, torch.full((1024,), 2.0))
    b.copy_async(slot, new, producer)
    b.synchronize()
    assert torch.equal(out, torch.full((1024,), 1.0))
    assert torch.equal(slot, torch.full((1024,), 2.0))


def kit_upload(b: FakeBackend, values: torch.Tensor) -> torch.Tensor:
    dev, src = b.empty_device(tuple(values.shape), values.dtype), pinned(b, values)
    b.copy_async(dev, src)
    b.synchronize()  # the source may only be dropped once the copy is known done
    return dev


@pytest.mark.unsanitized("reads the destination before synchronising, on purpose")
def test_without_chaos_destinations_are_not_poisoned(make):
    b = make(chaos=False, h2d_bandwidth=MIB / 0.2)
    src, dst = pinned(b, torch.ones(MIB // 4)), b.empty_device(MIB // 4, torch.float32)
    dst.zero_()
    s = b.new_stream()
    b.copy_async(dst, src, s)
    assert not dst.isnan().any()
    s.synchronize()
    assert torch.equal(dst, torch.ones(MIB // 4))


# -- bandwidth and overlap ----------------------------------------------------------------------


def test_bandwidth_model_makes_an_h2d_copy_take_size_over_bandwidth(make):
    """An H2D copy of n bytes takes at least n / bandwidth; a D2H copy is not throttled."""
    bandwidth = 4 * MIB / 0.3
    b = make(h2d_bandwidth=bandwidth)
    s = b.new_stream()
    src, dev, back = b.empty_pinned(4 * MIB), b.empty_device(4 * MIB), b.empty_pinned(4 * MIB)
    start = time.perf_counter()
    b.copy_async(dev, src, s)
    s.synchronize()
    h2d = time.perf_counter() - start
    assert h2d >= 4 * MIB / bandwidth * 0.98
    start = time.perf_counter()
    b.copy_async(back, dev, s)
    s.synchronize()
    assert time.perf_counter() - start < 0.15


def test_copies_on_two_streams_overlap_with_host_compute(make):
    """Two side-stream copies of T seconds each and T seconds of host work finish in about T,
    not 3T: streams really run concurrently (margins are wide for a loaded 2-core machine)."""
    T = 0.4
    b = make(h2d_bandwidth=MIB / T)
    streams = [b.new_stream(), b.new_stream()]
    bufs = [(b.empty_pinned(MIB), b.empty_device(MIB)) for _ in streams]
    start = time.perf_counter()
    for s, (src, dst) in zip(streams, bufs):
        b.copy_async(dst, src, s)
    time.sleep(T)  # host "compute" while the copies run
    b.synchronize()
    wall = time.perf_counter() - start
    assert T <= wall < 2 * T, f"wall {wall:.2f}s: sum would be {3 * T:.1f}s, max {T:.1f}s"
    a, c = [next(sp for sp in b.timeline.spans() if sp.stream == s.name) for s in streams]
    assert a.start_ns < c.end_ns and c.start_ns < a.end_ns, "the two copies did not overlap"


# -- trace --------------------------------------------------------------------------------------


def test_trace_records_spans_per_stream_and_exports_chrome_json(make, tmp_path):
    b = make()
    streams = [b.new_stream(), b.new_stream()]
    buffers = [(b.empty_pinned(1024), b.empty_device(1024), b.empty_pinned(1024)) for _ in streams]
    for s, (src, dst, back) in zip(streams, buffers):
        b.copy_async(dst, src, s)
        b.copy_async(back, dst, s)
    b.synchronize()
    spans = b.timeline.spans()
    for s in streams:
        mine = [sp for sp in spans if sp.stream == s.name]
        assert [sp.name for sp in mine] == ["H2D", "D2H"]
        assert all(sp.end_ns >= sp.start_ns and sp.nbytes == 1024 for sp in mine)
        assert mine[0].end_ns <= mine[1].start_ns  # FIFO on the timeline too

    path = tmp_path / "trace.json"
    b.export_chrome_trace(path)
    with open(path) as f:
        trace = json.load(f)
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    work = [e for e in events if e["ph"] == "X"]
    assert {names[e["tid"]] for e in work} >= {s.name for s in streams}
    assert len({e["tid"] for e in work}) >= 2
    assert all({"name", "ts", "dur", "pid", "tid"} <= e.keys() for e in work)


# -- threads and shutdown -----------------------------------------------------------------------


def test_close_stops_every_stream_thread(make):
    before = stream_threads()
    b = make()
    streams = [b.new_stream() for _ in range(3)]
    src, dsts = b.empty_pinned(4096), [b.empty_device(4096) for _ in streams]
    for s, dst in zip(streams, dsts):
        b.copy_async(dst, src, s)
    mine = stream_threads() - before
    assert len(mine) == 3
    b.close()
    assert not any(t.is_alive() for t in mine)
    assert all(s.query() for s in streams)  # queued work finished before the threads stopped


def test_a_dropped_stream_stops_its_thread():
    b = FakeBackend()
    before = stream_threads()
    s = b.new_stream()
    src, dst = b.empty_pinned(4096), b.empty_device(4096)
    b.copy_async(dst, src, s)
    s.synchronize()
    [thread] = stream_threads() - before
    del s
    gc.collect()
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_interpreter_exits_cleanly_with_a_busy_stream():
    """A process that ends while a stream is still copying exits at once with status 0: stream
    threads never keep an interpreter alive or crash its shutdown."""
    script = (
        "import offload_core\n"
        "b = offload_core.get_backend('fake', h2d_bandwidth=1e6)\n"  # 60 MB at 1 MB/s: a minute
        "s = b.new_stream()\n"
        "b.copy_async(b.empty_device(60_000_000), b.empty_pinned(60_000_000), s)\n"
        "assert not s.query()\n"
        "print('queued', flush=True)\n"
    )
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "queued\n" and "Fatal" not in proc.stderr and "Traceback" not in proc.stderr
    assert elapsed < 30, f"exit took {elapsed:.1f}s: it waited for the copy"


# -- options ------------------------------------------------------------------------------------


def test_environment_variables_set_the_options(monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_CHAOS", "1")
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_DEVICE_MEMORY", str(2 * MIB))
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_H2D_BANDWIDTH", "5e8")
    b = FakeBackend()
    try:
        assert b.chaos
        assert b.h2d_bandwidth == 5e8
        assert b.mem_get_info() == (2 * MIB, 2 * MIB)
        with pytest.raises(FakeOutOfMemoryError):
            b.empty_device(2 * MIB + 1)
    finally:
        b.close()


def test_keyword_options_override_environment_variables(monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_CHAOS", "1")
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_DEVICE_MEMORY", str(MIB))
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_H2D_BANDWIDTH", "5e8")
    b = FakeBackend(chaos=False, device_memory=3 * MIB, h2d_bandwidth=1e9)
    try:
        assert not b.chaos and b.h2d_bandwidth == 1e9 and b.mem_get_info()[1] == 3 * MIB
    finally:
        b.close()


@pytest.mark.parametrize(
    "options",
    [{"device_memory": -1}, {"pinned_memory": -5}, {"h2d_bandwidth": 0}, {"h2d_bandwidth": -1.0}, {"chaos_delay": -0.1}],
    ids=lambda o: next(iter(o.items())).__repr__(),
)
def test_invalid_options_raise_value_error(options):
    with pytest.raises(ValueError, match=next(iter(options))):
        FakeBackend(**options)


@pytest.mark.parametrize("var", ["OFFLOAD_CORE_FAKE_DEVICE_MEMORY", "OFFLOAD_CORE_FAKE_H2D_BANDWIDTH"])
def test_invalid_environment_values_raise_value_error(monkeypatch, var):
    monkeypatch.setenv(var, "lots")
    with pytest.raises(ValueError):
        FakeBackend()


def test_pinned_memory_cap(make):
    b = make(pinned_memory=MIB)
    keep = b.empty_pinned(MIB)
    with pytest.raises(torch.OutOfMemoryError):
        b.empty_pinned(1)
    assert b.pinned_memory_allocated() == MIB and keep.numel() == MIB


# -- errors ---------------------------------------------------------------------------------------


@pytest.mark.unsanitized("reads a destination whose copy never ran, on purpose")
def test_an_error_in_stream_work_is_raised_at_synchronize(make):
    """A copy that fails on the stream's thread is reported where a GPU reports asynchronous
    errors: at the next synchronisation (stream, event or backend), as a StreamError whose cause
    is the original exception. Work queued after it does not run."""
    b = make()
    s = b.new_stream()
    bad_dst = torch.zeros(1).expand(4)  # copy_ into overlapping memory raises
    b.copy_async(bad_dst, pinned(b, torch.arange(4.0)), s)
    done = b.new_event()
    done.record(s)
    later_dst = b.empty_device(4, torch.float32).zero_()
    b.copy_async(later_dst, pinned(b, torch.ones(4)), s)
    with pytest.raises(StreamError) as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(StreamError):
        done.synchronize()
    with pytest.raises(StreamError):
        b.synchronize()
    with pytest.raises(StreamError):
        done.wait()  # a wait on the default stream blocks the host, and reports too
    assert torch.equal(later_dst, torch.zeros(4))
