"""Streams and events of the fake device.

A side stream is a worker thread that runs its queue in order, so copies enqueued on it really
overlap with the host thread. The default stream is the calling thread itself: work "enqueued" on
it runs at once, which is exactly the ordering a GPU's default stream gives to host-issued
compute. Events capture a stream position; waiting for one on a side stream enqueues a task that
blocks that worker, and on the default stream blocks the caller.
"""

from __future__ import annotations

import atexit
import queue
import random
import threading
import time
import weakref
from typing import Callable

from offload_core.base.locks import locked

from .sanitizer import suspended, watching
from .trace import StreamTrace, now_ns

# Set at interpreter exit: workers stop after their current task and simulated waits end early.
_EXITING = threading.Event()
_QUEUES: weakref.WeakSet[_Queue] = weakref.WeakSet()
_EXIT_JOIN_SECONDS = 5.0


def pause(seconds: float) -> None:
    """Sleep on a stream's thread (chaos delays, the bandwidth model); cut short at exit."""
    _EXITING.wait(seconds)


@atexit.register
def _stop_workers_at_exit() -> None:
    """Let each worker leave torch code before the interpreter finalises.

    A daemon thread that comes back from a torch operation (which released the GIL) after
    finalisation has begun is ended by pthread_exit, whose unwinding through torch's C++ frames
    aborts the process ("terminate called without an active exception"). So the workers are
    stopped and joined here, while the interpreter is still whole; queued work is dropped, as a
    process exit drops a GPU's queued work.
    """
    _EXITING.set()
    queues = list(_QUEUES)
    for q in queues:
        locked(q.lock, q.cond.notify_all)
        q.stop()
    deadline = time.monotonic() + _EXIT_JOIN_SECONDS
    for q in queues:
        q.thread.join(max(deadline - time.monotonic(), 0.0))


class StreamError(RuntimeError):
    """Work on a fake stream raised; re-raised at the next synchronisation, as a GPU reports
    asynchronous errors."""


class _Chaos:
    """Random delay before each queued task, so that a missing wait shows every time."""

    def __init__(self, max_delay: float, seed: int) -> None:
        self.max_delay = max_delay
        self._rng = random.Random(seed)
        self._lock = threading.Lock()

    def delay(self) -> None:
        pause(locked(self._lock, self._rng.uniform, self.max_delay / 2, self.max_delay))


class _Queue:
    """State shared by a side stream's handle and its worker thread.

    The worker holds only this object, never the handle, so dropping the last handle stops the
    thread (the handle's weak reference, ``stopper``, is queued as the last task).
    """

    def __init__(self, name: str, timeline: StreamTrace, chaos: _Chaos | None) -> None:
        self.name = name
        self.timeline = timeline
        self.chaos = chaos
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        # taken directly (through locked) where no one waits: a Condition's own ``with`` is Python code
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.waiters = 0  # threads in wait_for: a finished task notifies only when someone waits
        self.enqueued = 0
        self.done = 0
        self.error: BaseException | None = None
        self.closed = False  # after close(), work runs on the submitting thread (see submit)
        self.stopper: weakref.ref | None = None  # the stream's death: see FakeStream
        self.thread = threading.Thread(target=self.run, name=f"offload-core-{name}", daemon=True)
        self.thread.start()
        _QUEUES.add(self)

    def submit(
        self,
        fn: Callable[[], None],
        label: str,
        nbytes: int,
        prepare: Callable[[], None] | None = None,
        inline: bool = False,
    ) -> int:
        seq, ran = locked(self.lock, self._take_turn, fn, label, nbytes, prepare, inline)
        if not ran:
            self.tasks.put((seq, fn, label, nbytes, prepare))
        return seq

    def _take_turn(
        self, fn: Callable[[], None], label: str, nbytes: int, prepare: Callable[[], None] | None, inline: bool
    ) -> tuple[int, bool]:
        """(the task's position, whether it ran here already) (the lock held)."""
        self.enqueued += 1
        seq = self.enqueued
        if self.closed:
            # no worker any more (backend.close() with a model still offloaded): run the work
            # here, in order, rather than queue it for nobody and hang its waiter
            self.waiters += 1
            self.cond.wait_for(lambda: self.done >= seq - 1 or _EXITING.is_set())
            self.waiters -= 1
            if prepare is not None and self.error is None:
                with suspended():
                    prepare()
            self._execute(fn, label, nbytes)
            self._mark_done(seq)
            return seq, True
        if inline and self.done == seq - 1 and self.error is None and prepare is None:
            # An idle stream starts the work at once: run it here, under the lock, so that no
            # later submission can overtake it. Waking the worker would cost more than a small
            # copy (two GIL handoffs), a cost no real device has.
            self._execute(fn, label, nbytes)
            self._mark_done(seq)
            return seq, True
        return seq, False

    def run(self) -> None:
        while True:
            item = self.tasks.get()
            if item is None or item is self.stopper or _EXITING.is_set():
                return
            seq, fn, label, nbytes, prepare = item
            try:
                if prepare is not None and self.error is None:
                    with suspended():
                        prepare()  # the task's turn has come: e.g. chaos poisons the copy destination
            except BaseException as exc:  # noqa: BLE001 - reported at the next synchronisation
                self.error = exc
            if self.chaos is not None:
                self.chaos.delay()
            self._execute(fn, label, nbytes)
            del item, fn, prepare  # the task's tensors must not outlive it (device memory accounting)
            locked(self.lock, self._mark_done, seq)

    def _execute(self, fn: Callable[[], None], label: str, nbytes: int) -> None:
        """Run one task and put it on the timeline; a failure is kept for the next synchronisation."""
        start = now_ns()
        try:
            if self.error is None:  # after a failure the stream only drains, as a faulted GPU would
                if watching():
                    with suspended():  # recorded by the sanitizer when it was enqueued
                        fn()
                else:
                    fn()
        except BaseException as exc:  # noqa: BLE001 - reported at the next synchronisation
            self.error = exc
        self.timeline.add(self.name, label, start, now_ns(), nbytes)

    def _mark_done(self, seq: int) -> None:
        """With the queue's lock held: tasks up to ``seq`` have run; wake whoever waits."""
        self.done = seq
        if self.waiters:
            self.cond.notify_all()

    def wait_for(self, seq: int) -> None:
        locked(self.lock, self._wait, seq)
        self.raise_error()

    def _wait(self, seq: int) -> None:
        self.waiters += 1
        try:
            self.cond.wait_for(lambda: self.done >= seq or _EXITING.is_set())
        finally:
            self.waiters -= 1

    def raise_error(self) -> None:
        if self.error is not None:
            raise StreamError(f"work on fake stream {self.name!r} failed: {self.error!r}") from self.error

    def stop(self) -> None:
        locked(self.lock, self._close)  # work submitted from now on runs inline; what was queued still drains
        self.tasks.put(None)

    def _close(self) -> None:
        self.closed = True


class FakeStream:
    """A side stream: its work runs in order on its own worker thread."""

    def __init__(self, name: str, timeline: StreamTrace, chaos: _Chaos | None, sanitizer=None) -> None:
        self._q = _Queue(name, timeline, chaos)
        # Dropping the last handle stops the worker, once what was queued has run: the reference's
        # callback queues the reference itself as the worker's last task. It is a C method, taking
        # no lock: a garbage collection runs it on whichever thread allocates, also the worker
        # while it holds the queue's lock, and a Ctrl-C cannot land half way through it. The queue
        # keeps the reference, so that it outlives a stream collected in a reference cycle.
        self._q.stopper = weakref.ref(self, self._q.tasks.put)
        self._san = sanitizer

    @property
    def name(self) -> str:
        return self._q.name

    def submit(
        self,
        fn: Callable[[], None],
        label: str,
        nbytes: int = 0,
        prepare: Callable[[], None] | None = None,
        inline: bool = False,
    ) -> int:
        """Enqueue ``fn``; returns its position, usable with ``reached``/``wait_for``.

        ``prepare`` runs when the stream reaches the task, before the chaos delay and ``fn``.
        ``inline``: if the stream is idle, run ``fn`` at once on the calling thread (for work so
        short that a thread handoff would cost more than the work)."""
        return self._q.submit(fn, label, nbytes, prepare, inline)

    def position(self) -> int:
        return self._q.enqueued

    def reached(self, seq: int) -> bool:
        return self._q.done >= seq

    def passed(self, seq: int) -> bool:
        """``reached``, re-raising a failure of the work run so far when it has."""
        q = self._q
        if q.done < seq:
            return False
        if q.error is not None:
            q.raise_error()
        return True

    def wait_for(self, seq: int) -> None:
        self._q.wait_for(seq)

    def synchronize(self) -> None:
        self._q.wait_for(self._q.enqueued)
        if self._san is not None:
            self._san.on_stream_sync(self)

    def query(self) -> bool:
        done = self._q.done >= self._q.enqueued
        if done and self._san is not None:
            self._san.on_stream_sync(self)
        return done

    def close(self) -> None:
        """Finish queued work, then stop the worker thread."""
        self._q.stop()
        self._q.thread.join()

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class DefaultStream:
    """The default stream: the calling thread. Its work runs on submission."""

    name = "default"

    def __init__(self, timeline: StreamTrace, sanitizer=None) -> None:
        self._timeline = timeline
        self._san = sanitizer

    def submit(
        self,
        fn: Callable[[], None],
        label: str,
        nbytes: int = 0,
        prepare: Callable[[], None] | None = None,
        inline: bool = True,
    ) -> int:
        with suspended():  # recorded by the sanitizer when it was enqueued
            if prepare is not None:
                prepare()
            start = now_ns()
            fn()
        self._timeline.add(self.name, label, start, now_ns(), nbytes)
        return 0

    def position(self) -> int:
        return 0

    def reached(self, seq: int) -> bool:
        return True

    def passed(self, seq: int) -> bool:
        return True

    def wait_for(self, seq: int) -> None:
        return None

    # Its work has run by now; for the sanitizer it is complete only once the host asks.
    def synchronize(self) -> None:
        if self._san is not None:
            self._san.on_stream_sync(self)

    def query(self) -> bool:
        if self._san is not None:
            self._san.on_stream_sync(self)
        return True

    def __repr__(self) -> str:
        return "<FakeStream default>"


class FakeEvent:
    """A captured stream position. ``wait`` on a side stream enqueues a blocking task there;
    ``wait`` on the default stream blocks the calling thread (its later work is the caller's)."""

    def __init__(
        self, current: Callable[[], FakeStream | DefaultStream], timeline: StreamTrace, sanitizer=None
    ) -> None:
        self._current = current
        self._timeline = timeline
        self._stream: FakeStream | DefaultStream | None = None
        self._seq = 0
        self._san = sanitizer
        self._vc: dict[int, int] | None = None  # the sanitizer's vector clock at record

    def record(self, stream: FakeStream | DefaultStream | None = None) -> None:
        stream = stream if stream is not None else self._current()
        self._stream, self._seq = stream, stream.position()
        if self._san is not None:
            self._vc = self._san.on_record(stream)

    def query(self) -> bool:
        reached = self._stream is None or self._stream.reached(self._seq)
        if reached and self._san is not None:
            self._san.on_host_sync(self._vc)
        return reached

    def synchronize(self) -> None:
        if self._stream is not None:
            self._stream.wait_for(self._seq)
        if self._san is not None:
            self._san.on_host_sync(self._vc)

    def wait(self, stream: FakeStream | DefaultStream | None = None) -> None:
        target = stream if stream is not None else self._current()
        if self._san is not None:
            self._san.on_wait(self._vc, target)
        source, seq = self._stream, self._seq
        if source is None or source is target:
            return  # unrecorded, or same-stream order already holds
        if source.passed(seq):  # nothing to wait for, but a failure of that work surfaces
            return
        if isinstance(target, DefaultStream):
            start = now_ns()
            source.wait_for(seq)
            self._timeline.add(target.name, f"wait {source.name}", start, now_ns())
            return
        target.submit(lambda: source.wait_for(seq), f"wait {source.name}")


class FakeTimingEvent(FakeEvent):
    """An event that also notes when its stream reached it (``new_event(timing=True)``), like a
    ``torch.Event(enable_timing=True)``: the default stream is reached at once, a side stream when
    its worker runs a stamp queued at the record."""

    def __init__(
        self, current: Callable[[], FakeStream | DefaultStream], timeline: StreamTrace, sanitizer=None
    ) -> None:
        super().__init__(current, timeline, sanitizer)
        self._reached_ns: int | None = None

    def record(self, stream: FakeStream | DefaultStream | None = None) -> None:
        stream = stream if stream is not None else self._current()
        self._reached_ns = None
        stream.submit(self._stamp, "event", inline=True)
        super().record(stream)

    def _stamp(self) -> None:
        self._reached_ns = now_ns()

    def elapsed_time(self, end: FakeTimingEvent) -> float:
        """Milliseconds from this event to ``end``; both must have been recorded (host-blocking)."""
        for event in (self, end):
            event.synchronize()
            if event._reached_ns is None:
                raise RuntimeError("elapsed_time needs two recorded events")
        return (end._reached_ns - self._reached_ns) / 1e6
