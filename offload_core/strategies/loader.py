"""The loads of a layerwise part's streamed blocks: the only caller of its transport's copies.

Every load takes the same steps (the slot's last reader done, the slot released and claimed, the
copies issued on the copy stream or handed to the stager, the ready event recorded after them),
and the host must know when none is in flight any more before it writes host memory
(``quiesce``). They are kept here, with the slot ring, the copy stream and the load records they
touch, so that the part's passes and checks ask for a load, a queue of loads or a wait and do no
slot or stream bookkeeping of their own. The loader holds its part weakly: the part owns it, and a
reference cycle would keep a disabled part alive until the next garbage collection.
"""

from __future__ import annotations

import functools
import logging
import weakref

from ..common.timeline import UNTRACED
from ..weights.binding import Homes
from .ring import LoadRecord, SlotRing, kept_views

logger = logging.getLogger(__name__)


class BlockLoader:
    """The slot ring, copy stream and load records of one layerwise part, and its loads."""

    def __init__(self, part, backend, transport) -> None:
        self.part = weakref.proxy(part)
        self.backend = backend
        self.transport = transport
        self.counters = part.counters
        self.ring: SlotRing | None = None  # made by the part's enable, dropped by its disable or park
        self.records: list[LoadRecord] = []
        self.homes: Homes | None = None  # what every streamed block shows at home, checked before each pass
        self.copy_stream = None
        self.images: tuple = ()  # the streamed blocks' disk images (None: in RAM), in run order
        self.queued = False  # copies were queued since the host last waited for the copy stream

    def make_records(self) -> None:
        """The blocks' load records into the slots the ring just made, and what refers to them."""
        part, backend = self.part, self.backend
        self.records = [part._load_record(i, backend.new_event()) for i in range(len(part.units))]
        self.homes = Homes([record.binding for record in self.records])
        self.images = tuple(record.image for record in self.records)  # what the read-ahead is told about
        part.saved.index(self.ring.views_index())
        # the ring's own references to each slot, counted at rest: more, later, means that
        # something outside the ring still holds the slot (see ring.py)
        self.ring.settle()

    def drop(self) -> None:
        """Forget the slots and the load records (the part frees the rest of its device memory)."""
        self.ring = None
        self.records = []
        self.homes = None

    def load(self, i: int) -> None:
        """Queue block ``i``'s transfers into its slot once the slot's last reader is done."""
        record, ring = self.records[i], self.ring
        slot = record.slot
        if not ring.at_rest(slot):
            self._renew(slot)
            record = self.records[i]
        ring.release(slot)  # an interrupted load leaves the slot empty, not stale
        self.queued = True
        stager = self.part.placement.stager
        if stager is None:
            self._queue_load(record)
        else:
            # The stager waits on the slot's free event later: safe, because it is recorded again
            # only after block i has run, and block i runs only after this load's ticket.
            record.ticket = stager.submit(functools.partial(self._stage_load, record))
        ring.claim(slot, i)
        counters = self.counters
        counters.loads += 1
        counters.h2d_copies += record.copies
        counters.h2d_bytes += record.nbytes

    def _renew(self, slot: int) -> None:
        """Something outside the ring still references ``slot``: leave it that memory and make
        the load records of the slot's blocks again, for the new memory the ring gives the slot."""
        part = self.part
        occupant = self.ring.occupant(slot)
        holding = f"block {part.block_names[occupant]}" if occupant >= 0 else "no block"
        old = self.ring.buffers_at(slot)
        if not self.ring.renew(slot, self.copy_stream, holding, part.describe()):
            return
        for where in kept_views(part.model, old):
            logger.warning(
                "%s: %s keeps a view of the device copy of offloaded weights across forwards: it reads the weights of "
                "the forward that made it, never later changes to them (also after disable()). Make it again in each "
                "forward, or keep a .clone()", part.describe(), where,
            )
        self.counters.retired_slot_bytes += self.ring.nbytes
        for j in self.ring.blocks_of(slot, len(self.records)):
            record = self.records[j]
            self.records[j] = part._load_record(j, record.ready, record.ticket)
        part.saved.index(self.ring.views_index())
        self.ring.settle(slot)

    def _stage_load(self, record: LoadRecord) -> None:
        """A load on the stager thread: the blocks on disk after this one are read ahead while
        it is staged (see ``hostmem.staging.ReadAhead``)."""
        self.part.placement.staging_block(self.images, record.index)
        self._queue_load(record)

    def _queue_load(self, record: LoadRecord) -> None:
        stream = self.copy_stream
        self.ring.wait_free(record.slot, stream)
        try:
            timeline = self.part.timeline
            if timeline is None:
                self.transport.issue(record, stream)
            else:
                issue = functools.partial(self.transport.issue, record, stream)
                timeline.copy(stream, self.span_name(record.index), record.nbytes, issue)
        finally:  # also after a failure half-way: what waits for block i waits for what was queued
            record.ready.record(stream)

    def queue(self, first: int, count: int) -> None:
        """Load blocks ``first`` .. ``first + count - 1`` (those that exist) not in their slots yet;
        several under one stream context (``backend.batch``) unless the stager issues them (on its
        own thread) or a slot must be renewed first (an allocation, which must not happen inside)."""
        ring = self.ring
        todo = [j for j in range(first, min(first + count, len(self.records))) if not ring.holds(j)]
        if len(todo) > 1 and self.part.placement.stager is None and all(ring.at_rest(ring.slot_of(j)) for j in todo):
            with self.backend.batch(self.copy_stream):
                for j in todo:
                    self.load(j)
            return
        for j in todo:
            self.load(j)

    def wait_ready(self, i: int, reader=None) -> None:
        """Make compute (a trace records the wait), or the stream ``reader``, wait until block
        ``i`` is in its slot."""
        record = self.records[i]
        if record.ticket is not None:
            ticket, record.ticket = record.ticket, None
            self.part.placement.wait(ticket)
        if reader is not None:  # not compute: the distributed read-back at disable
            record.ready.wait(reader)
            return
        stream = self.backend.current_stream()
        timeline = self.part.timeline
        with UNTRACED if timeline is None else timeline.compute_after(stream, self.span_name(i)):
            record.ready.wait(stream)

    def load_for_backward(self, i: int, miss: bool) -> None:
        """Block ``i`` in its slot for its backward: unless it is there, loaded once the backward
        issued so far (which read the slot's last block) is done."""
        ring = self.ring
        if ring is not None and ring.holds(i):
            return
        ring.mark_free(ring.slot_of(i), self.backend.current_stream())
        if miss:
            self.count_miss(i)
        self.load(i)

    def restore(self) -> None:
        """Before the part's ``disable`` unpacks: every unit gets its full host values. A copy's
        homes hold them already; a rank's shards are rebuilt by its pairing, every block gathered
        once more and read back."""
        pairing = self.transport.pairing
        if pairing is None:
            return
        # blocks loaded early inside frozen() were gathered with the other ranks' next loads: they
        # are this disable's first loads, as they would be a forward's, not loaded again
        passes = self.part.passes
        preloaded, passes.preloaded = {i for i, _ in passes.preloaded}, []
        reader = self.backend.new_stream()

        def fetch(i: int):
            if i not in preloaded or not self.ring.holds(i):
                self.load(i)
            self.wait_ready(i, reader)
            return self.records[i].unit

        try:
            self.quiesce(forget=not preloaded)
            pairing.restore(fetch, reader)
        finally:
            self.quiesce()

    def versions(self, i: int) -> tuple[int, ...]:
        return self.records[i].binding.versions()

    def count_miss(self, i: int) -> None:
        """Block ``i`` is needed now and no prefetch brought it: its load cannot overlap."""
        self.counters.prefetch_misses += 1
        timeline = self.part.timeline
        if timeline is not None:
            timeline.prefetch_miss(self.span_name(i))

    def span_name(self, i: int) -> str:
        part = self.part
        return f"{part.label}.{part.block_names[i]}"

    def quiesce(self, forget: bool = True) -> None:
        """Wait until no queued copy reads host memory any more; forget what the slots hold
        (unless ``forget`` is False: the slots keep blocks a backward will read)."""
        if self.queued:  # the whole stream: a load interrupted half-way recorded no event
            self.part.placement.drain()  # loads handed to the stager are on the stream first
            self.copy_stream.synchronize()
            self.landed()
        if forget and self.ring is not None:
            self.ring.forget()

    def landed(self) -> None:
        """Every load queued so far has landed (the host waited for the copy stream)."""
        self.queued = False
        for record in self.records:
            record.ticket = None
