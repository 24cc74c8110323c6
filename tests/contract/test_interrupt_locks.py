"""Issue 42, item 2 (docs/design.md, contract row 8 and "Threads and streams"): no interrupt leaves
a library lock held, and none corrupts what a finalizer counts.

Each test runs a piece of the library's bookkeeping (labels, the memory accounting of the
backends, the pinned slabs, the fake backend's memory and streams) once per point it reaches, with
a ``KeyboardInterrupt`` raised at that point by a trace function, as
``tests/contract/test_interrupts.py`` does for whole model calls. A point is a line event (the
line and the instruction it starts at): the line of a ``with`` statement is reached again where
its block ends, before its lock is released, which is where the issue's hang came from. After
each point, the same bookkeeping is used from another thread under a deadline (a lock left held
fails the test instead of hanging it), and its counts must equal the truth.
"""

from __future__ import annotations

import gc
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch

import offload_core
from offload_core.common import labels
from offload_core.device.memory_accounting import AllocationTracker, HostRegistrations, power_of_two_ceil
from offload_core.hostmem.slabs import SlabAllocator

from interrupting import LIBRARY, Injected, Tracer

ROOTS = (LIBRARY, str(Path(__file__).parents[2] / "backends" / "fake"))
DEADLINE = 30.0


pytestmark = pytest.mark.usefixtures("frozen_heap")


def traced(tracer: Tracer, operation) -> None:
    sys.settrace(tracer)
    try:
        operation()
    except Injected:
        pass
    finally:
        sys.settrace(None)


#: set once a lock was left held: later tests fail at once instead of blocking on it too
_held: list[str] = []


def in_time(work):
    """``work()`` on another thread, done within ``DEADLINE`` seconds (a lock left held blocks it):
    its result, or what it raised, raised here."""
    assert not _held, f"not run: {_held[0]}"
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((work(), None))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            outcome.append((None, exc))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(DEADLINE)
    if worker.is_alive():
        _held.append("an earlier test left a lock held")
        raise AssertionError("blocked: an interrupt left a lock held")
    result, error = outcome[0]
    if error is not None:
        raise error
    return result


def sweep(fresh, operation, check) -> int:
    """For every point ``operation(state)`` reaches, on a ``fresh()`` state: interrupt it there,
    then ``check(state)`` on another thread. Each on a thread of its own, under the deadline.
    Returns the points fired."""
    listing = Tracer(roots=ROOTS)
    first = in_time(fresh)
    in_time(lambda: traced(listing, lambda: operation(first)))
    fired = 0
    for point in listing.reached:
        tracer = Tracer(point, ROOTS)
        state = in_time(fresh)
        in_time(lambda: traced(tracer, lambda: operation(state)))
        fired += tracer.fired
        try:
            in_time(lambda: check(state))
        except AssertionError as exc:
            raise AssertionError(f"after an interrupt at {point[0]}:{point[1]} (instruction {point[2]}): {exc}") from exc
    assert fired == len(listing.reached) > 3
    return fired


# -- labels -------------------------------------------------------------------------------


def test_labels_after_an_interrupt_at_any_point():
    """The issue's hang: an interrupt where ``label``'s locked block ended left its lock held, and
    the next model-level load waited for it forever."""

    def operation(slab):
        labels.label(slab[:4], "first")  # the storage's first label
        labels.label(slab[2:6], "second")  # overlaps the first: replaces it
        labels.describe(slab[3:])

    def check(slab):
        labels.label(slab[8:12], "later")
        assert labels.describe(slab[9:]) == "later"
        fresh = torch.empty(4)
        labels.label(fresh, "fresh")
        assert labels.describe(fresh) == "fresh"

    sweep(lambda: torch.empty(16), operation, check)


def test_a_garbage_collection_inside_label_does_not_deadlock():
    """A collection can run at any allocation inside ``label`` and free a labelled storage there."""

    class Cycle:
        """Freed only by the cyclic garbage collector."""

    def collect_at_every_line(frame, event, arg):
        if frame.f_code.co_filename == labels.__file__:
            gc.collect()  # frees the storage below, inside label, at each of its lines
            return collect_at_every_line
        return None

    def label_with_collections_inside():
        for _ in range(3):
            cycle = Cycle()
            cycle.self, cycle.tensor = cycle, torch.empty(16)
            labels.label(cycle.tensor, "in a reference cycle")
            del cycle
            sys.settrace(collect_at_every_line)
            try:
                labels.label(torch.empty(4), "fresh")
            finally:
                sys.settrace(None)

    in_time(label_with_collections_inside)
    kept = torch.empty(8)
    in_time(lambda: labels.label(kept, "kept"))
    assert in_time(lambda: labels.describe(kept)) == "kept"


def test_a_storage_takes_its_labels_with_it():
    def labelled() -> int:
        before = len(labels._labels)
        t = torch.empty(8)
        labels.label(t[:4], "a")
        labels.label(t[4:], "b")
        assert len(labels._labels) == before + 1 and labels.describe(t[5:]) == "b"
        del t
        return before

    assert in_time(labelled) == len(labels._labels)


# -- memory accounting ----------------------------------------------------------------------


class Allocations:
    """A tracker and the tensors it handed out, with the counts they should give."""

    def __init__(self, caching: bool) -> None:
        self.tracker = AllocationTracker("test", capacity=1 << 20, block_size=power_of_two_ceil if caching else None,
                                         caches_freed=caching)
        self.caching = caching
        self.live: list[torch.Tensor] = [self.tracker.allocate(n, torch.uint8) for n in (100, 300, 1000)]
        self.freed: list[int] = []

    def drop(self, k: int) -> None:
        self.freed.append(self.tracker.block_size(self.live[k].numel()))
        self.live[k] = None  # the storage dies here: a finalizer in the old code

    def truth(self) -> tuple[int, int]:
        live = sum(self.tracker.block_size(t.numel()) for t in self.live if t is not None)
        return live, sum(self.freed) if self.caching else 0


@pytest.mark.parametrize("caching", [False, True], ids=["exact", "caching"])
def test_memory_counts_stay_exact_whatever_the_interrupt(caching):
    """An interrupt inside a storage's finalizer (``_release`` of the old tracker) was swallowed
    with the bytes never given back; one inside ``allocate`` left a reservation counted."""

    def operation(state: Allocations) -> None:
        state.drop(1)  # a storage dies
        state.tracker.current  # noqa: B018 - a reader gives its bytes back
        state.live.append(state.tracker.allocate(50, torch.uint8))  # allocated: counted once
        state.drop(0)
        state.tracker.held  # noqa: B018

    def check(state: Allocations) -> None:
        gc.collect()
        tracker = state.tracker
        assert tracker.current == state.truth()[0]
        assert all(tracker.owns(t) for t in state.live if t is not None)
        # cached: what was freed, and an allocation the interrupt stopped after it was made
        assert tracker.cached - state.truth()[1] in ((0, 64) if caching else (0,))
        more = tracker.allocate(2000, torch.uint8)
        assert tracker.current == state.truth()[0] + tracker.block_size(2000)
        live = state.truth()[0]
        tracker.empty_cache()
        del more
        state.live.clear()  # every block freed, and cached by the caching one
        assert (tracker.current, tracker.held) == (0, live + 2048 if caching else 0)

    sweep(lambda: Allocations(caching), operation, check)


def test_an_allocation_at_the_address_of_one_not_yet_given_back_is_counted_once():
    """A storage that dies while the next allocation is made hands its address over before its
    bytes are given back: the new one is the tracker's, and each is counted once."""
    tracker = AllocationTracker("test")
    memory = torch.empty(4096, dtype=torch.uint8).untyped_storage()

    def at_the_same_address(shape, dtype):  # a new storage viewing the same bytes (same key)
        return torch.empty(0, dtype=torch.uint8).set_(memory[0:4096])

    first = [tracker.allocate(4096, torch.uint8, at_the_same_address)]

    def dropping_the_first(shape, dtype):  # it dies inside the next allocate, after its give-back
        first.clear()
        return at_the_same_address(shape, dtype)

    second = tracker.allocate(4096, torch.uint8, dropping_the_first)
    assert tracker.current == 4096 and tracker.owns(second)
    del second
    assert tracker.current == 0


def test_host_registrations_after_an_interrupt_at_any_point():
    page = 4096

    def operation(ranges: HostRegistrations) -> None:
        ranges.add(0x10000, 2 * page)
        ranges.add(0x40000, page)
        ranges.remove(0x10000)

    def check(ranges: HostRegistrations) -> None:
        ranges.add(0x80000, page)
        ranges.remove(0x80000)
        for start in (0x10000, 0x40000):  # finish what the interrupt stopped
            if ranges.covers(start) != (start == 0x40000):
                (ranges.remove if ranges.covers(start) else lambda ptr: ranges.add(ptr, page))(start)
        assert ranges.bytes == page and ranges.covers(0x40000) and not ranges.covers(0x10000)

    sweep(HostRegistrations, operation, check)


# -- pinned slabs -----------------------------------------------------------------------------

REQUEST = 24 << 10


class Slabs:
    """Pinned slabs on a fake whose host allocator rounds to powers of two: two 24 KiB requests
    share a 64 KiB slab."""

    def __init__(self) -> None:
        self.backend = offload_core.get_backend("fake", chaos=False, sanitize=False, pinned_rounding="pow2")
        self.slabs = SlabAllocator(self.backend, slab_bytes=1 << 16)
        self.views = [self.slabs.allocate(REQUEST, torch.uint8) for _ in range(3)]  # two slabs

    def truth(self) -> int:
        return len({v.untyped_storage().data_ptr() for v in self.views if v is not None})


def test_slab_counts_stay_exact_whatever_the_interrupt():
    """An interrupt inside a slab's finalizer (``_released`` of the old allocator) was swallowed
    with the slab still counted."""

    def operation(state: Slabs) -> None:
        state.views[2] = None  # the second slab dies
        state.views.append(state.slabs.allocate(REQUEST, torch.uint8))  # a third
        state.slabs.live_slabs  # noqa: B018

    def check(state: Slabs) -> None:
        gc.collect()
        assert state.slabs.live_slabs == state.truth()
        assert state.slabs.live_bytes == state.truth() << 16
        state.backend.empty_host_cache()
        assert state.backend.pinned_memory_allocated() == state.slabs.live_bytes
        state.views = []
        gc.collect()
        state.backend.empty_host_cache()
        assert state.slabs.live_slabs == 0 and state.backend.pinned_memory_allocated() == 0

    assert Slabs().slabs.live_slabs == 2
    sweep(Slabs, operation, check)


# -- the fake backend -----------------------------------------------------------------------


def test_the_fake_backends_memory_stays_exact_whatever_the_interrupt():
    """The fake's device and pinned pools (the tracker, and the spans that say which addresses are
    its memory): after an interrupt anywhere in allocating or dropping, the counts are the live
    tensors' bytes and a dead tensor's memory is not the fake's any more."""

    def fresh():
        backend = offload_core.get_backend("fake", chaos=False, sanitize=False)
        return backend, [backend.empty_device(256, torch.float32), backend.empty_pinned(1024)]


    def operation(state) -> None:
        backend, tensors = state
        tensors[0] = None
        tensors.append(backend.empty_device(64, torch.float32))
        backend.memory_allocated()

    def check(state) -> None:
        backend, tensors = state
        gc.collect()
        device = sum(t.numel() * t.element_size() for t in tensors[::2] if t is not None)
        assert backend.memory_allocated() == device
        assert backend.pinned_memory_allocated() == 1024
        assert all(backend.is_pinned(t) for t in tensors[1:2])
        tensors.clear()
        gc.collect()
        assert backend.memory_allocated() == 0 and backend.pinned_memory_allocated() == 0

    sweep(fresh, operation, check)


def test_a_dropped_fake_stream_stops_its_worker_without_a_finalizer_lock():
    """The worker of a stream collected in a reference cycle stops, also when the collection runs
    on that worker while it holds its queue's lock (the old finalizer took that lock there)."""
    backend = offload_core.get_backend("fake", chaos=False, sanitize=False)
    stream = backend.new_stream()
    stream.cycle = stream  # freed only by the cyclic collector
    queue = stream._q
    original = queue._mark_done

    def collect_while_locked(seq):  # called with the queue's lock held
        original(seq)
        if threading.current_thread() is queue.thread:
            gc.collect()  # frees the stream, here

    queue._mark_done = collect_while_locked
    gate = threading.Event()
    stream.submit(gate.wait, "held until the stream is garbage")  # to the worker, not inline
    del stream
    gate.set()
    queue.thread.join(DEADLINE)
    assert not queue.thread.is_alive(), "the worker never stopped: its stream's finalizer waited for its own lock"


def test_a_dropped_stager_stops_its_worker_whatever_interrupts_its_drop():
    """The stager thread of staged homes stops when its stager is dropped (collected in a reference
    cycle here), also when an interrupt lands in the first Python code of the library or of the
    finalizer machinery that the drop runs (the old finalizer's: swallowed, and the thread waited
    for a stop that never came)."""
    from offload_core.hostmem.staging import Stager

    roots = (*ROOTS, weakref.__file__)

    def interrupt_the_first_call(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(roots):
            sys.settrace(None)
            raise Injected("as the stager is dropped")
        return None

    def collect() -> None:
        sys.settrace(interrupt_the_first_call)
        try:
            gc.collect()
        finally:
            sys.settrace(None)

    gc.disable()  # the collection below is the one that frees the stager
    try:
        stager = Stager()
        stager.cycle = stager
        worker = stager._thread
        del stager
        in_time(collect)
    finally:
        gc.enable()
    worker.join(DEADLINE)
    assert not worker.is_alive(), "the stager's worker never stopped"
