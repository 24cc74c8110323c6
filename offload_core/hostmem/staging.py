"""The bounce ring and the stager: how weights without a pinned home reach the device.

An asynchronous host-to-device copy needs page-locked memory on the host side. Weights whose home
is ordinary (pageable) memory, or a file, are therefore copied chunk by chunk into a small ring
of pinned *bounce buffers*, and each chunk goes to the device from there on the copy stream. A
bounce buffer is written again only after the host has synchronised with an event recorded after
the copy that last read it: the host never overwrites bytes a queued copy has yet to read.

Filling a bounce buffer is host work (a memcpy, or a read from disk) that can take as long as
the copy itself. The *stager* does it on its own thread, so the thread that issues compute is
never held up: a strategy hands each load (waits, copies, the ready event) to the stager as one
task, tasks run in the order they were submitted, and the strategy waits for a task's ticket
before it makes compute wait on the task's ready event (an event must be recorded before a
stream can wait on it).
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from typing import Callable

import torch
from ..errors import StagingError


logger = logging.getLogger(__name__)

#: bytes per bounce buffer, and how many the ring holds: a chunk is filled while the previous
#: ones are copied, and four chunks of read-ahead cover a disk read's latency spikes
BOUNCE_CHUNK_BYTES = 16 * 2**20
BOUNCE_BUFFERS = 4

Reader = Callable[[int, int, torch.Tensor], None]  # read(start, count, out): elements into ``out``


def ring_chunk_bytes(largest: int) -> int:
    """The size of one bounce buffer for staged buffers of at most ``largest`` bytes."""
    return max(64, min(BOUNCE_CHUNK_BYTES, -(-largest // 64) * 64))


class BounceRing:
    """A few pinned buffers, filled on the host and copied to the device in turn."""

    def __init__(self, backend, allocate: Callable[[int, torch.dtype], torch.Tensor], chunk_bytes: int,
                 count: int = BOUNCE_BUFFERS, copy: Callable | None = None) -> None:
        """``copy(dst, src, stream)`` issues each chunk's copy: the backend's ``copy_async``, or,
        for pageable buffers (``pin_memory=False``), the placement's blocking copy."""
        self.backend = backend
        self.copy = copy if copy is not None else backend.copy_async
        self.chunk_bytes = chunk_bytes
        self.buffers = [allocate(chunk_bytes, torch.uint8) for _ in range(count)]
        self.read_done = [backend.new_event() for _ in range(count)]
        self._used = [False] * count
        self._next = 0
        self.staged_bytes = 0  # written on the stager thread only

    @property
    def nbytes(self) -> int:
        return self.chunk_bytes * len(self.buffers)

    def copies(self, nbytes: int) -> int:
        """Copies needed to stage ``nbytes``."""
        return -(-nbytes // self.chunk_bytes)

    def stage(self, dst: torch.Tensor, read: Reader, stream) -> None:
        """Queue on ``stream`` the copy of ``read``'s elements into ``dst`` (flat, on the device),
        one bounce buffer at a time."""
        dtype = dst.dtype
        per_chunk = self.chunk_bytes // dtype.itemsize
        total = dst.numel()
        for start in range(0, total, per_chunk):
            count = min(per_chunk, total - start)
            k = self._next
            self._next = (k + 1) % len(self.buffers)
            if self._used[k]:
                self.read_done[k].synchronize()  # the copy that last read buffer k has run
            bounce = self.buffers[k][: count * dtype.itemsize].view(dtype)
            read(start, count, bounce)
            self.copy(dst[start : start + count], bounce, stream)
            self.read_done[k].record(stream)
            self._used[k] = True
            self.staged_bytes += count * dtype.itemsize


class Ticket:
    """Set once the stager has issued a task (its copies queued, its events recorded)."""

    __slots__ = ("_done", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None


_STAGERS: weakref.WeakSet = weakref.WeakSet()
_EXITING = threading.Event()
_exit_hook: list = []  # the exit hook, once registered


class Stager:
    """One worker thread that issues loads in submission order."""

    def __init__(self, on_start: Callable[[], None] | None = None, name: str = "offload-core-stager") -> None:
        """``on_start`` runs first on the new thread (binding it to the device); if it fails,
        every task reports that failure."""
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_work, args=(self._queue, on_start), name=name, daemon=True)
        self._thread.start()
        weakref.finalize(self, self._queue.put, None)  # the thread holds only the queue
        if not _exit_hook:
            # registered on first use, after the backends' own hooks, so that it runs before
            # them: the task in progress may still wait on their streams
            _exit_hook.append(atexit.register(_stop_stagers))
        _STAGERS.add(self)

    def submit(self, task: Callable[[], None]) -> Ticket:
        ticket = Ticket()
        self._queue.put((task, ticket))
        return ticket

    def wait(self, ticket: Ticket) -> None:
        """Block until ``ticket``'s task has been issued; re-raise its failure here."""
        ticket._done.wait()
        if ticket.error is not None:
            raise StagingError(f"staging weights failed: {ticket.error}") from ticket.error

    def drain(self) -> None:
        """Block until every task submitted so far has run (or was skipped after a failure, which
        the waits of the failed loads report): disable and rollback must work after a failure."""
        self.submit(lambda: None)._done.wait()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def _work(tasks: queue.SimpleQueue, on_start: Callable[[], None] | None) -> None:
    """The stager's loop. After a task fails, later tasks are not run (their copies would wait
    on events the failed task never recorded): each reports the first failure."""
    failed: BaseException | None = None
    try:
        if on_start is not None:
            on_start()
    except BaseException as exc:  # noqa: BLE001 - reported by every task's ticket
        logger.exception("the stager thread could not bind to its device")
        failed = exc
    while True:
        item = tasks.get()
        if item is None or _EXITING.is_set():
            return
        task, ticket = item
        try:
            if failed is None:
                task()
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting thread
            logger.exception("the stager failed while issuing a load")
            failed = exc
        ticket.error = failed
        ticket._done.set()
        item = task = None  # a finished task must not keep its strategy (and a dropped model) alive


def _stop_stagers() -> None:
    """Let stager threads leave torch code while the interpreter is still whole (a daemon thread
    returning from a torch call during finalisation aborts the process): each finishes the task
    in progress and drops the rest, as a process exit drops a device's queued work."""
    _EXITING.set()
    for stager in list(_STAGERS):
        stager._queue.put(None)
    for stager in list(_STAGERS):
        stager._thread.join(5.0)
