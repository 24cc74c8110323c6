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

Blocks on disk are read every time they run, so the drive must never wait for the stager. The
stager tells a :class:`ReadAhead` which block it starts staging; on its own thread, that asks
the kernel to read the blocks that run next (in run order, wrapping to the first block for the
next step) into its page cache, as far as a window of bytes reaches. The stager's reads then find
their bytes arriving or arrived, the drive has large requests queued while the stager copies and
while compute runs, and what is read ahead sits in the page cache, which the kernel reclaims,
never in this process's resident memory.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import queue
import threading
import time
import weakref
from typing import Callable, Sequence

import torch
from ..base.errors import StagingError
from ..weights.slices import ALIGN
from . import hugepages


logger = logging.getLogger(__name__)

#: bytes per bounce buffer, and how many the ring holds: a chunk is filled while the previous
#: ones are copied, and four chunks of read-ahead cover a disk read's latency spikes
BOUNCE_CHUNK_BYTES = 16 * 2**20
BOUNCE_BUFFERS = 4
#: bytes of disk blocks read ahead beyond the one being staged (at least the next block): two
#: blocks of the largest models' streamed stacks, a few seconds of a drive's sequential read
READ_AHEAD_BYTES = 1536 * 2**20

#: read(start, count, out): elements into ``out``; returns the bytes it read from disk (or None).
#: A reader of a unit on disk also has ``submit``, the same read queued (see ``BounceRing.stage``)
Reader = Callable[[int, int, torch.Tensor], "int | None"]


def ring_chunk_bytes(largest: int, disk: bool = False) -> int:
    """The size of one bounce chunk for staged buffers of at most ``largest`` bytes (``disk``:
    some of them on disk, whole pages where that is two pages or more: :func:`page_chunks`)."""
    step = ALIGN if disk and largest >= 2 * ALIGN else 64
    return max(64, min(BOUNCE_CHUNK_BYTES, -(-largest // step) * step))


def page_chunks(chunk_bytes: int) -> bool:
    """Whether a ring of ``chunk_bytes`` chunks lays disk homes out as their files do within a
    page (:meth:`BounceRing.shift`): chunks of whole pages, two at least."""
    return chunk_bytes % ALIGN == 0 and chunk_bytes >= 2 * ALIGN


def ring_buffer_bytes(chunk_bytes: int, paged: bool) -> int:
    """What one bounce buffer of ``chunk_bytes`` chunks takes: a page more in a ring that stages
    disk homes (``paged``) where its chunks are pages (:func:`page_chunks`), so that they start on
    a page whatever the allocator's alignment."""
    return chunk_bytes + ALIGN if paged and page_chunks(chunk_bytes) else chunk_bytes


class BounceRing:
    """A few pinned buffers, filled on the host and copied to the device in turn."""

    def __init__(self, backend, allocate: Callable[[int, torch.dtype], torch.Tensor], chunk_bytes: int,
                 count: int = BOUNCE_BUFFERS, copy: Callable | None = None, paged: bool = False) -> None:
        """``copy(dst, src, stream)`` issues each chunk's copy: the backend's ``copy_async``, or,
        for pageable buffers (``pin_memory=False``), the placement's blocking copy. ``paged``: the
        ring stages disk homes, its chunks start on a page (:meth:`shift`)."""
        self.backend = backend
        self.copy = copy if copy is not None else backend.copy_async
        self.chunk_bytes = chunk_bytes
        self.paged = paged and page_chunks(chunk_bytes)
        self.buffers = [allocate(ring_buffer_bytes(chunk_bytes, self.paged), torch.uint8) for _ in range(count)]
        for buffer in self.buffers:  # before the first write: disk reads land here (see .hugepages)
            hugepages.advise(buffer.data_ptr(), buffer.nbytes)
        if self.paged:
            self.buffers = [b[-b.data_ptr() % ALIGN :][:chunk_bytes] for b in self.buffers]
        self.read_done = [backend.new_event() for _ in range(count)]
        self._used = [False] * count
        self._next = 0
        # written on the stager thread only
        self.staged_bytes = 0
        self.disk_read_bytes = 0  # bytes read from files into the ring
        self.disk_read_seconds = 0.0  # time those reads took (waiting for the drive included)

    @property
    def nbytes(self) -> int:
        return ring_buffer_bytes(self.chunk_bytes, self.paged) * len(self.buffers)

    def copies(self, nbytes: int, residue: int | None = None) -> int:
        """Copies needed to stage ``nbytes`` (read as :meth:`stage` reads with ``residue``)."""
        return -(-(nbytes + self.shift(residue)) // self.chunk_bytes)

    def shift(self, residue: int | None) -> int:
        """Where in its bounce buffer the first chunk of a staged buffer starts: ``residue``
        (its file bytes' offset less their place in the buffer, modulo a page: :data:`ALIGN`), so
        that every byte then lies in the ring as it lies in its file modulo a page and the readers
        read whole pages straight into place. 0 (chunks at the buffers' starts, as for a buffer
        in RAM) without a residue, or in a ring that does not start its chunks on a page."""
        return residue if residue and self.paged else 0

    def stage(self, transfers: Sequence[tuple[torch.Tensor, Reader, int | None]], stream) -> None:
        """Queue on ``stream`` the copy of each transfer's ``read`` elements into its ``dst``
        (flat, on the device), one bounce buffer at a time; a transfer's first chunk starts
        ``shift(residue)`` bytes into its buffer and holds that much less, the others fill theirs.
        The chunks of all the transfers (a block's dtypes) are one sequence: a reader that can
        queue its reads (``read.submit``: a unit on disk) has a chunk's reads queued in every
        buffer whose last copy has run, the next transfer's too, so that the drive has the next
        chunks to read while one is copied and a block's small dtypes cost no round trip of their
        own; each chunk is copied once its reads have landed, in order."""
        pending: collections.deque = collections.deque()  # (buffer, dst, bounce, bytes read, landed)
        try:
            for dst, read, residue in transfers:
                submit = getattr(read, "submit", None)
                ahead = len(self.buffers) if submit is not None else 1
                dtype, total, shift, start = dst.dtype, dst.numel(), self.shift(residue), 0
                while start < total:
                    if _EXITING.is_set():  # a big load would outlast the exit hook's join
                        raise StagingError("the interpreter is exiting: the load was stopped")
                    while len(pending) >= ahead:
                        self._copy(pending.popleft(), stream)
                    count = min((self.chunk_bytes - shift) // dtype.itemsize, total - start)
                    k = self._next
                    self._next = (k + 1) % len(self.buffers)
                    if self._used[k]:
                        self.read_done[k].synchronize()  # the copy that last read buffer k has run
                    bounce = self.buffers[k][shift : shift + count * dtype.itemsize].view(dtype)
                    began = time.perf_counter()
                    from_disk, landed = submit(start, count, bounce) if submit else (read(start, count, bounce), None)
                    self.disk_read_seconds += (time.perf_counter() - began) if from_disk else 0.0
                    pending.append((k, dst[start : start + count], bounce, from_disk, landed))
                    start += count
                    shift = 0
            while pending:
                self._copy(pending.popleft(), stream)
        except BaseException:
            for *_, landed in pending:  # no read may still write a buffer the next load fills
                if landed is not None:
                    with contextlib.suppress(BaseException):
                        landed()
            raise

    def _copy(self, chunk, stream) -> None:
        """Once its reads have landed, queue the copy of one pending chunk from its buffer."""
        k, dst, bounce, from_disk, landed = chunk
        if landed is not None:
            began = time.perf_counter()
            landed()
            self.disk_read_seconds += (time.perf_counter() - began) if from_disk else 0.0
        self.disk_read_bytes += from_disk or 0
        self.copy(dst, bounce, stream)
        self.read_done[k].record(stream)
        self._used[k] = True
        self.staged_bytes += bounce.nbytes


class ReadAhead:
    """Keeps the kernel reading the disk blocks that run next (see the module's docstring).

    Told on the stager thread which block it starts staging (:meth:`staging`), it decides there
    what to ask for: the images after that block in run order, until ``window`` bytes are asked
    for beyond it (always at least the next one), each once per pass; the blocks the stager has
    reached are forgotten. Its own thread makes the requests, in that order: a request returns once
    the kernel has queued the reads, which can take a while on a busy drive."""

    def __init__(self, window: int | None = None) -> None:
        self.window = READ_AHEAD_BYTES if window is None else window
        self.peak_bytes = 0  # the most bytes ever asked for ahead of the block being staged
        self._blocks: Sequence | None = None
        self._ahead: collections.deque = collections.deque()  # (index, bytes) asked for, in run order
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=_advise, args=(self._requests,), name="offload-core-readahead",
                                        daemon=True)
        self._thread.start()

    def staging(self, images: Sequence, i: int) -> None:
        """The stager starts staging block ``i`` of ``images`` (a part's blocks' disk images in run
        order, None for a block in RAM: the images alone, so that nothing here holds device memory)."""
        if images is not self._blocks:
            self._blocks = images
            self._ahead.clear()
        ahead = self._ahead
        if any(j == i for j, _ in ahead):
            while ahead.popleft()[0] != i:  # the stager has gone past these
                pass
        else:  # a pass starts, or a block runs out of order: what was asked for is stale
            ahead.clear()
            if images[i] is not None:
                self._requests.put(images[i])
        n, asked = len(images), sum(size for _, size in ahead)
        j = (ahead[-1][0] if ahead else i) + 1
        while j % n != i:
            image = images[j % n]
            if image is not None:
                size = image.file_bytes
                if ahead and asked + size > self.window:
                    break
                self._requests.put(image)
                ahead.append((j % n, size))
                asked += size
                self.peak_bytes = max(self.peak_bytes, asked)
            j += 1

    def close(self) -> None:
        """Stop once the requests made so far are made."""
        self._requests.put(None)
        self._thread.join()


def _advise(requests: queue.SimpleQueue) -> None:
    """The read-ahead thread: ask for each image in turn (it holds only the queue)."""
    while (image := requests.get()) is not None:
        try:
            image.advise()
        except Exception:  # noqa: BLE001 - a hint that failed: the stager's reads still read
            logger.exception("reading ahead failed")


class Ticket:
    """Set once the stager has issued a task (its copies queued, its events recorded)."""

    __slots__ = ("_done", "error")

    def __init__(self) -> None:
        self._done = threading.Event()
        self.error: BaseException | None = None


_STAGERS: weakref.WeakSet = weakref.WeakSet()
#: each live stager's weak reference, whose callback queues the reference itself when the stager is
#: dropped (a C call: no Python code runs where a garbage collection drops it, and no Ctrl-C lands
#: half way); kept here until its worker, or close(), takes it
_STOPPERS: set = set()
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
        self._stopper = weakref.ref(self, self._queue.put)  # the thread holds only the queue
        _STOPPERS.add(self._stopper)
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
        _STOPPERS.discard(self._stopper)


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
        if type(item) is weakref.ref:  # the stager was dropped
            _STOPPERS.discard(item)
            return
        if item is None or _EXITING.is_set():
            return
        task, ticket = item
        try:
            if failed is None:
                task()
        except BaseException as exc:  # noqa: BLE001 - reported to the waiting thread
            if not _EXITING.is_set():
                logger.exception("the stager failed while issuing a load")
            failed = exc
        ticket.error = failed
        ticket._done.set()
        item = task = None  # a finished task must not keep its strategy (and a dropped model) alive


def _stop_stagers() -> None:
    """Let stager threads leave torch code while the interpreter is still whole (a daemon thread
    returning from a torch call during finalisation aborts the process): each stops the load in
    progress at its next chunk (a group of gigabytes from disk would outlast the join) and drops
    the rest, as a process exit drops a device's queued work."""
    _EXITING.set()
    for stager in list(_STAGERS):
        stager._queue.put(None)
    for stager in list(_STAGERS):
        stager._thread.join(5.0)
