"""The race sanitizer of the fake backend, on hand-written stream programs through the public
DeviceBackend API: each racy sequence is reported, naming both sides, and the same sequence with
the missing ordering added is not. Every case runs with chaos mode on and off: the report comes
from the ordering, not from timing."""

from __future__ import annotations

import gc

import pytest
import torch
import torch.multiprocessing as mp

import offload_core
from offload_core.common.labels import label
from offload_core.testing import SimulatorCapability
from offload_core_fake import StreamRaceError

from helpers import free_port

N = 256


@pytest.fixture(params=[False, True], ids=["plain", "chaos"])
def b(request):
    backend = offload_core.get_backend("fake", sanitize=True, chaos=request.param, chaos_delay=0.001)
    yield backend
    backend.close()


def pinned(b, values: torch.Tensor) -> torch.Tensor:
    return b.empty_pinned(tuple(values.shape), values.dtype).copy_(values)


def uploaded(b, values: torch.Tensor) -> torch.Tensor:
    """A device buffer holding ``values``, with the upload known finished by the host."""
    dev, src = b.empty_device(tuple(values.shape), values.dtype), pinned(b, values)
    b.copy_async(dev, src)
    b.synchronize()
    return dev


# -- read-after-write ---------------------------------------------------------------------------


@pytest.mark.parametrize("ordered", [False, True])
def test_compute_reading_a_copy_destination(b, ordered):
    side = b.new_stream()
    src, dev = pinned(b, torch.arange(N, dtype=torch.float32)), b.empty_device(N, torch.float32)
    b.copy_async(dev, src, side)
    ready = b.new_event()
    ready.record(side)
    if ordered:
        ready.wait()
        assert torch.equal(dev * 2, torch.arange(N, dtype=torch.float32) * 2)
    else:
        with pytest.raises(StreamRaceError) as race:
            dev * 2
        report = str(race.value)
        assert report.startswith("read-after-write race on fake device memory")
        assert "read by aten.mul.Tensor on stream 'default'" in report
        assert f"write by copy_async (H2D) on stream '{side.name}'" in report
        assert f"tensor ({N},) float32, bytes [0, {4 * N})" in report
        assert "tests/backends/test_sanitizer.py" in report and "in test_compute_reading_a_copy_destination" in report
    b.synchronize()


def test_wait_stream_orders_like_an_event(b):
    side = b.new_stream()
    src, dev = pinned(b, torch.ones(N)), b.empty_device(N, torch.float32)
    b.copy_async(dev, src, side)
    b.wait_stream(b.current_stream(), side)
    assert float(dev.sum()) == N
    b.synchronize()


# -- write-after-read: the class chaos mode cannot see -------------------------------------------


@pytest.mark.parametrize("ordered", [False, True])
def test_copy_into_a_slot_that_compute_still_reads(b, ordered):
    side = b.new_stream()
    slot = uploaded(b, torch.ones(N))
    _ = slot.sum()  # compute reads the slot (asynchronous on a device)
    free = b.new_event()
    free.record()
    nxt = pinned(b, torch.full((N,), 2.0))
    if ordered:
        free.wait(side)
        b.copy_async(slot, nxt, side)
    else:
        with pytest.raises(StreamRaceError, match=r"^write-after-read race(?s:.*)read by aten\.sum"):
            b.copy_async(slot, nxt, side)
    b.synchronize()


# -- write-after-write ---------------------------------------------------------------------------


@pytest.mark.parametrize("ordered", [False, True])
def test_two_streams_writing_one_buffer(b, ordered):
    side = b.new_stream()
    dev = b.empty_device(N, torch.float32)
    dev.zero_()
    src = pinned(b, torch.ones(N))
    if ordered:
        b.wait_stream(side, b.current_stream())
        b.copy_async(dev, src, side)
    else:
        with pytest.raises(StreamRaceError, match=r"^write-after-write race(?s:.*)write by aten\.zero_"):
            b.copy_async(dev, src, side)
    b.synchronize()


# -- byte ranges ------------------------------------------------------------------------------------


def test_views_of_one_flat_buffer_race_only_where_their_bytes_overlap(b):
    side = b.new_stream()
    flat = b.empty_device(2 * N, torch.float32)
    src = pinned(b, torch.ones(N))
    b.copy_async(flat[:N], src, side)  # the first half is being written
    flat[N:].sum()  # the second half: disjoint bytes, no race
    with pytest.raises(StreamRaceError, match=rf"bytes \[{4 * (N - 1)}, {4 * (N + 1)}\)"):
        flat[N - 1 : N + 1].sum()  # one element of each half
    b.synchronize()


def test_a_strided_view_spans_the_bytes_it_can_touch(b):
    side = b.new_stream()
    flat = b.empty_device(4 * N, torch.float32)
    src = pinned(b, torch.ones(N))
    b.copy_async(flat[3 * N :], src, side)  # the last quarter
    flat[: 2 * N].view(N, 2)[:, 0].sum()  # even elements of the first half: disjoint
    with pytest.raises(StreamRaceError):
        flat.view(N, 4)[:, 3].sum()  # every fourth element reaches into the last quarter
    b.synchronize()


# -- collectives ------------------------------------------------------------------------------------


def _gather_worker(rank: int, port: int, chaos: bool) -> None:
    torch.set_num_threads(1)
    b = offload_core.get_backend("fake", sanitize=True, chaos=chaos, chaos_delay=0.001)
    b.init_process_group(rank, 2, f"tcp://127.0.0.1:{port}")
    side = b.new_stream()
    inp = uploaded(b, torch.full((N,), float(rank)))
    out = b.empty_device(2 * N, torch.float32)
    done = b.all_gather_into_tensor(out, inp, stream=side)
    try:
        out.sum()  # the gather's output read too early
    except StreamRaceError as race:
        assert "read-after-write" in str(race) and "write by all_gather" in str(race)
    else:
        raise AssertionError("reading an all-gather output before waiting was not reported")
    done.wait()
    assert torch.equal(out, torch.cat([torch.zeros(N), torch.ones(N)]))
    b.synchronize()
    b.close()
    torch.distributed.barrier()  # neither rank leaves while the other still talks to it
    torch.distributed.destroy_process_group()


@pytest.mark.parametrize("chaos", [False, True], ids=["plain", "chaos"])
def test_an_all_gather_output_read_before_its_waitable(chaos):
    mp.spawn(_gather_worker, args=(free_port(), chaos), nprocs=2, join=True)


# -- the host --------------------------------------------------------------------------------------


@pytest.mark.parametrize("sync", [None, "event", "stream", "backend", "query"])
def test_the_host_reading_a_d2h_result(b, sync):
    side = b.new_stream()
    dev = uploaded(b, torch.arange(N, dtype=torch.float32))
    back = b.empty_pinned(N, torch.float32)
    b.copy_async(back, dev, side)
    done = b.new_event()
    done.record(side)
    if sync is None:
        with pytest.raises(StreamRaceError, match=r"read-after-write race on fake pinned memory(?s:.*)host aten"):
            back.clone()
        b.synchronize()
        return
    if sync == "event":
        done.synchronize()
    elif sync == "stream":
        side.synchronize()
    elif sync == "backend":
        b.synchronize()
    else:
        while not done.query():
            pass
    assert torch.equal(back, torch.arange(N, dtype=torch.float32))


# -- lifetimes --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["device source", "device destination"])
def test_dropping_a_buffer_while_a_copy_may_still_touch_it(b, kind):
    side = b.new_stream()
    src, dst = uploaded(b, torch.ones(N)), b.empty_device(N, torch.float32)
    b.copy_async(dst, src, side)
    if kind == "device source":
        del src
    else:
        del dst
    gc.collect()
    with pytest.raises(StreamRaceError, match=r"freed \(its last reference dropped\) while work that touches it"):
        b.synchronize()


@pytest.mark.parametrize("direction", ["H2D source", "D2H destination"])
def test_dropping_a_pinned_buffer_after_queuing_its_copy_is_safe(b, direction):
    """CUDA's and torch_npu's caching host allocators record an event on the copy's stream and
    reuse a pinned block only after it: the release needs no wait, and the copy still lands."""
    side = b.new_stream()
    host, dev = pinned(b, torch.full((N,), 3.0)), uploaded(b, torch.full((N,), 5.0))
    kept = dev if direction == "H2D source" else None
    if direction == "H2D source":
        b.copy_async(dev, host, side)
    else:
        b.copy_async(host, dev, side)
    del host
    gc.collect()
    side.synchronize()
    b.synchronize()
    if kept is not None:
        assert torch.equal(kept, torch.full((N,), 3.0))


def test_dropping_buffers_after_the_host_knows_the_copy_is_done(b):
    side = b.new_stream()
    src, dst = pinned(b, torch.ones(N)), b.empty_device(N, torch.float32)
    b.copy_async(dst, src, side)
    side.synchronize()
    del src, dst
    gc.collect()
    b.synchronize()


@pytest.mark.parametrize("ordered", [False, True])
def test_a_new_buffer_may_reuse_memory_that_compute_still_reads(b, ordered):
    """A caching allocator hands a freed block to the next allocation on its stream at once, so a
    side-stream copy into a fresh buffer must wait for the compute that read the old one."""
    side = b.new_stream()
    old = uploaded(b, torch.ones(N))
    old.sum()  # compute on the default stream reads it...
    del old  # ...and the host drops it, legal: it was allocated on that same stream
    gc.collect()
    fresh, src = b.empty_device(N, torch.float32), pinned(b, torch.ones(N))
    if ordered:
        b.wait_stream(side, b.current_stream())
        b.copy_async(fresh, src, side)
    else:
        with pytest.raises(StreamRaceError, match=r"^write-after-read(?s:.*)read by aten\.sum"):
            b.copy_async(fresh, src, side)
    b.synchronize()


# -- reports and switches ------------------------------------------------------------------------------


def test_a_report_names_the_label_a_strategy_gave_the_memory(b):
    side = b.new_stream()
    slot = b.empty_device(N, torch.float32)
    label(slot, lambda: "slot 1 of layerwise Tiny (block blocks.3)")
    src = pinned(b, torch.ones(N))
    b.copy_async(slot, src, side)
    with pytest.raises(StreamRaceError, match=r"in slot 1 of layerwise Tiny \(block blocks\.3\)"):
        slot.sum()
    b.synchronize()


def test_the_same_race_is_silent_without_the_sanitizer():
    """A read of a copy's destination with no wait: reported with the sanitizer, unsaid without."""
    for sanitize in (True, False):
        b = offload_core.get_backend("fake", sanitize=sanitize)
        assert (b.sanitizer is not None) is sanitize
        side = b.new_stream()
        src, dev = pinned(b, torch.ones(N)), b.empty_device(N, torch.float32)
        b.copy_async(dev, src, side)
        if sanitize:
            with pytest.raises(StreamRaceError, match=r"^read-after-write"):
                dev.sum()
        else:
            dev.sum()  # racy, and nobody says so
        b.synchronize()
        b.close()


def test_the_environment_variable_turns_it_on(monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_SANITIZE", "1")
    assert offload_core.get_backend("fake", chaos=False).sanitizer is not None
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_SANITIZE", "0")
    assert offload_core.get_backend("fake", chaos=False).sanitizer is None


def test_it_is_on_by_default_under_pytest_backend_fake(backend, new_backend):
    assert SimulatorCapability.SANITIZE in type(backend).capabilities
    assert backend.sanitizer is not None
    assert new_backend().sanitizer is not None
    assert offload_core.get_backend("fake", chaos=True).sanitizer is not None  # built by a test itself


@pytest.mark.unsanitized("checks the opt-out marker itself")
def test_the_unsanitized_marker_turns_it_off(new_backend):
    assert new_backend().sanitizer is None
    assert offload_core.get_backend("fake", chaos=True).sanitizer is None


def test_dropping_a_buffer_never_waits_for_the_sanitizer_lock(b):
    """A buffer can die anywhere a garbage collection runs, on any thread, while that thread holds
    another lock: recording the drop must not wait for the sanitizer, or two threads deadlock."""
    import threading

    held = {"tensor": b.empty_device(N, torch.float32)}
    dropper = threading.Thread(target=held.clear)
    with b.sanitizer._lock:  # another thread is inside the sanitizer
        dropper.start()
        dropper.join(timeout=10)
        assert not dropper.is_alive(), "dropping a tracked buffer waited for the sanitizer's lock"
    b.synchronize()
