"""The sharded transport of distributed layerwise offloading: each rank keeps 1/N of every block.

Each block's per-dtype buffer is padded to a multiple of the world size and split into N equal
shards; rank r keeps shard r in pinned memory. Loading a block copies this rank's shard into a
small staging buffer, then an all-gather on the copy stream rebuilds the whole block in the slot
on every rank. Host memory per rank is then the resident part plus 1/N of the blocks. The shards
are the part's home policy's (homes.py, ``ShardHomePolicy``: it cuts and keeps them); this transport
loads from them and writes a forward's changes back into them.

The gathers never run on the compute stream: the copy stream is one side stream per process that
every distributed part shares (collectives then run in one order on every rank), and compute waits
for a block through its ready event, recorded there after the gathers' waits. So a collective
library whose asynchronous collectives still hold their stream (HCCL) delays only the copy stream;
a block's header gather, shard copies and gathers are queued under one stream context
(``backend.batch``).

Every rank must run the same forwards in the same order (the all-gathers are collective). The
ranks are kept honest rather than trusted:

* Each load first all-gathers a small header (block index, the part's serial number, a status).
  When a pass ends the host checks every header of the pass: a gather that paired different
  blocks on different ranks raises :class:`DistributedOffloadError` instead of returning an
  output computed on mismatched weights.
* Every pass (and every block called outside a forward, and every backward) ends with one more
  header, which says whether the rank got through. A rank whose forward fails still issues the
  gathers of the blocks the others will load in that pass and its end header, marked as aborted,
  so the other ranks finish the pass, see the abort and raise too, and the ranks stay in step.
* ``disable`` is collective: it rebuilds the full host weights on every rank, checks every
  header, and only then gives the weights back; if the ranks are out of step it raises and
  changes nothing. Its loads and its end header say DISABLING: a rank's disable that meets
  another rank's forward (same blocks, same count of gathers) fails on both ranks, naming both.
* Inside ``handle.frozen()`` a pass's end loads the next pass's first blocks early. Their gathers
  say PRELOADED: they are the first loads of whatever this rank does next (a forward, or
  ``disable``, which uses them as a forward would instead of gathering them again), so a rank
  runs the same gathers with or without ``frozen()``; what that next operation is, its other
  loads and its end header say.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..base.errors import DistributedOffloadError
from ..hostmem.placement import Tier
from ..common.labels import label
from ..planning.planner import GATHER_GATHERED_BYTES, GATHER_SENT_BYTES
from ..weights import nbytes_of
from .common import allocate_device
from .homes import ShardHomePolicy
from .transport import RankCopy

logger = logging.getLogger(__name__)

#: header of one load: magic, the part's serial number, block index (END for the end of a pass),
#: status; the device bytes of the headers are the planner's GATHER_SENT_BYTES and GATHER_GATHERED_BYTES
HEADER = 4
MAGIC = 0x0FF10AD
#: a forward's loads are OK (ABORTED: the rank failed); disable's rebuilding loads say DISABLING,
#: so that a rank's disable never pairs with another rank's forward; loads queued early inside
#: ``frozen()`` say PRELOADED (the operation they start is not known yet)
OK, ABORTED, DISABLING, PRELOADED = 0, 1, 2, 3
STATUSES = (OK, ABORTED, DISABLING, PRELOADED)
END = -1


class ShardedGather(RankCopy):
    """Loads a block as this rank's shard plus an all-gather, and keeps the ranks' loads paired
    (its own :class:`~.transport.RankPairing`); see the module docstring."""

    def __init__(self, ranks, policy: ShardHomePolicy) -> None:
        super().__init__()
        self.world, self.rank, self.group = ranks.world, ranks.rank, ranks.group
        self.policy = policy  # its shards: what it loads from and writes a forward's changes back into
        self.serial = -1
        self._aborted: set[int] = set()  # blocks whose next load carries an aborted header
        self._preloading: set[int] = set()  # blocks whose next load carries a preloaded header
        self._pending: list[tuple[int, int]] = []  # (header row, block) of loads not yet checked
        self._loaded_in_pass = -1  # the furthest block loaded in this pass (a failed rank drains on)
        self._disabling = False  # restore's loads carry DISABLING headers
        self._staging: list = []
        self._rebuilt: list = []  # full host buffers of the blocks restore read back so far
        self._header_in = self._header_out = self._rows = None

    @property
    def pairing(self) -> "ShardedGather":
        return self

    @property
    def _header_rows(self) -> int:
        return 2 * (len(self.at.names.blocks) + 1)

    def device_bytes(self, blocks: int, slots: int, slot_shape) -> int:
        staging = slots * nbytes_of({d: n // self.world for d, n in slot_shape.items()})
        return staging + (blocks + 1) * (GATHER_SENT_BYTES + GATHER_GATHERED_BYTES * self.world)

    def serve(self, context) -> None:
        """What the loads use from now on; unparked (a ring in ``context``), the staging buffers
        and the header tensors beside the slots, the header rows written into them once the ranks
        agreed; parked, none of them; released (None), the rows too."""
        super().serve(context)
        self._staging, self._header_in, self._header_out = [], None, None
        self._pending, self._loaded_in_pass = [], -1
        if context is None:
            self._rows = None
        if context is None or context.ring is None:
            return
        blocks, backend = len(context.names.blocks), context.backend
        self._staging = [
            allocate_device(backend, {d: n // self.world for d, n in context.ring.shape.items()},
                            f"all-gather staging buffer {s} of {context.names.part}")
            for s in range(len(context.ring))
        ]
        self._header_out = backend.empty_device((self._header_rows, self.world * HEADER), torch.int64)
        self._header_in = backend.empty_device((blocks + 1, len(STATUSES), HEADER), torch.int64)
        label(self._header_out, f"gathered load headers of {context.names.part}")
        label(self._header_in, f"load headers of {context.names.part}")
        self._write_rows()

    def agreed(self, serial: int) -> None:
        """Every rank enabled alike; ``serial`` numbers this part the same on every rank. Makes
        the header rows every load gathers (one per block, then the end of a pass)."""
        self.serial = serial
        self._rows = torch.tensor(
            [[[MAGIC, serial, i, status] for status in STATUSES] for i in [*range(len(self.at.names.blocks)), END]],
            dtype=torch.int64,
        )
        self._write_rows()

    def _write_rows(self) -> None:
        """Copy the header rows to the device, where both exist. No load ran since; the gathers
        follow on the same stream, and the host rows stay referenced until released, so nothing
        waits here."""
        if self._rows is not None and self._header_in is not None:
            self._backend.copy_async(self._header_in, self._rows, self.at.copy_stream)

    # -- loads ------------------------------------------------------------------------------------
    def prepare_load(self, i: int, unit, slot):
        shards, staging = self.policy.shards[i], self._staging[self.at.ring.slot_of(i)]
        direct = self._placement.tier(unit) in (Tier.PINNED, Tier.PAGEABLE)
        transfers = [
            (staging[dtype][: shard.numel()], shard if direct else functools.partial(_read_flat, shard),
             slot[dtype][: shard.numel() * self.world])
            for dtype, shard in shards.items()
        ]
        copies = self._placement.copies([(staged, src) for staged, src, _ in transfers])
        nbytes = sum(s.numel() * s.element_size() for s in shards.values())
        return transfers, copies, nbytes, None, functools.partial(self._write_back_shard, i)

    def issue(self, record, stream) -> None:
        """The block's header gather, then per dtype its shard's copy and gather, all under one
        stream context (``stream`` is the copy stream the headers are gathered on too)."""
        backend, placement = self._backend, self._placement
        with backend.batch(stream):
            self._gather_header(record.index, self._header_status(record.index))
            self._loaded_in_pass = max(self._loaded_in_pass, record.index)
            for staging, shard, out in record.transfers:
                placement.issue([(staging, shard)], stream)
                backend.all_gather_into_tensor(out, staging, self.group, stream).wait(stream)

    def _gather_header(self, i: int, status: int) -> None:
        """Queue the all-gather of block ``i``'s header (``END``: the end of a pass)."""
        if len(self._pending) == self._header_rows:
            self._check_headers()
        row, stream = len(self._pending), self.at.copy_stream
        header, out = self._header_in[i, status], self._header_out[row]
        gathered = self._backend.all_gather_into_tensor(out, header, self.group, stream)
        gathered.wait(stream)
        self._pending.append((row, i))

    def _header_status(self, i: int) -> int:
        """Block ``i``'s header status, read where its load is issued (on the stager thread for
        staged shards) and consumed there."""
        if self._disabling:
            return DISABLING
        if i in self._aborted:
            self._aborted.discard(i)
            return ABORTED
        if i in self._preloading:
            self._preloading.discard(i)
            return PRELOADED
        return OK

    def preloading(self, blocks) -> None:
        """The next loads of ``blocks`` are queued early, inside ``frozen()``."""
        self._preloading.update(blocks)

    def _write_back_shard(self, i: int, pairs) -> None:
        """A forward changed block ``i``'s tensors (a buffer updated in place; the slot holds the
        new values): copy this rank's slice of the slot into its shard. Every rank runs the same
        forward, so every rank updates its own slice alike. The headers are checked first, so that
        values computed on mismatched weights are never kept."""
        backend, ring = self._backend, self.at.ring
        self._placement.drain()  # the stager appends the headers of the loads it issues
        self._check_headers()
        slot = ring.buffers_of(i)
        stream = backend.current_stream()
        with backend.batch(stream):
            for dtype, shard in self.policy.shards[i].items():
                size = shard.numel()
                backend.copy_async(shard, slot[dtype][self.rank * size : (self.rank + 1) * size], stream)
        done = backend.new_event()
        done.record(stream)
        done.synchronize()

    # -- the ends of passes ---------------------------------------------------------------------
    def end_pass(self, failed: bool, load=None) -> None:
        """The end of a pass, of a backward, or of a block called alone: say whether this rank got
        through, and check every header since the last check. A rank whose forward failed first
        issues, through ``load`` (the part's), the loads the other ranks still run in this pass
        (the blocks after the furthest one loaded here), each with an aborted header."""
        try:
            self._placement.drain()  # the stager's loads: how far this pass got; their gathers come first
            if failed and load is not None:
                for i in range(self._loaded_in_pass + 1, len(self.at.names.blocks)):
                    self._aborted.add(i)  # read where its load is issued
                    try:
                        load(i)
                    except BaseException:
                        self._aborted.discard(i)
                        raise
                self._placement.drain()
            with self._backend.batch(self.at.copy_stream):  # the end header and its read-back
                self._gather_header(END, ABORTED if failed else OK)
                if failed:
                    try:
                        self._check_headers()
                    except DistributedOffloadError as exc:
                        logger.warning("after this rank's failure: %s", exc)
                else:
                    self._check_headers()
        finally:
            self._loaded_in_pass = -1  # loads queued from here on belong to the next pass

    def _check_headers(self) -> None:
        """Wait for the queued gathers and compare every rank's header of each: a gather that
        paired different blocks, or a rank that aborted its pass, is an error here."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        at = self.at
        seen = torch.empty((len(pending), self.world * HEADER), dtype=torch.int64)
        self._backend.copy_async(seen, self._header_out[: len(pending)], at.copy_stream)  # after the gathers
        at.copy_stream.synchronize()
        at.landed()  # every load queued so far has landed
        headers = seen.view(len(pending), self.world, HEADER).tolist()
        self._check_operations(headers)
        for (_, block), row in zip(pending, headers):
            for rank, header in enumerate(row):
                if header[:3] != [MAGIC, self.serial, block]:
                    raise DistributedOffloadError(
                        f"ranks out of step in {at.names.what}: this rank (rank {self.rank}) was at "
                        f"{self._label(block)} while rank {rank} was at {self._label_of(header)} in the same gather; "
                        "the output of this call is discarded (gathers that pair different blocks would mix their "
                        "weights). Every rank must run the same forwards in the same order"
                    )
        for row in headers:
            for rank, header in enumerate(row):
                if header[3] == ABORTED:
                    raise DistributedOffloadError(
                        f"rank {rank} failed during this forward of {at.names.what}; its output is discarded on "
                        "every rank. The ranks are still in step: the next forward can run"
                    )

    def _check_operations(self, headers: list) -> None:
        """A gather of one rank's disable paired with another rank's forward: an error on both.
        A row with a preloaded load says nothing (that rank's next operation says what it is)."""
        doing = {True: "handle.disable()", False: "a forward"}
        for row in headers:
            if any(header[3] == PRELOADED for header in row):
                continue
            for rank, header in enumerate(row):
                if header[0] == MAGIC and header[1] == self.serial and (header[3] == DISABLING) != self._disabling:
                    raise DistributedOffloadError(
                        f"ranks out of step in {self.at.names.what}: this rank (rank {self.rank}) ran "
                        f"{doing[self._disabling]} while rank {rank} ran {doing[not self._disabling]}; "
                        "nothing was computed or changed on either rank. handle.disable() is collective: "
                        "call it on every rank, at the same point"
                    )

    def _label(self, block: int) -> str:
        return "the end of a forward" if block == END else f"block {self.at.names.blocks[block]}"

    def _label_of(self, header: list[int]) -> str:
        magic, serial, block, _ = header
        if magic != MAGIC or serial != self.serial or not END <= block < len(self.at.names.blocks):
            return "another model's gather or unrelated data"
        return self._label(block)

    # -- disable ----------------------------------------------------------------------------------
    def restore(self, fetch, reader) -> None:
        """Disable: every block is loaded once more, with DISABLING headers (``fetch(i)``: the
        part's, block ``i`` in its slot for ``reader``; it returns the block's unit), and read
        back, rebuilding the full weights from the shards on every rank. Then checks that every
        rank gathered the same blocks and makes the rebuilt buffers the units' homes. If the ranks
        are out of step, raises and changes nothing (``disable`` can be called again)."""
        try:
            self._check_headers()
            self._disabling = True
            for i in range(len(self.at.names.blocks)):
                self._read_back(i, fetch(i), reader)
            with self._backend.batch(self.at.copy_stream):  # as a forward ends: the same count of gathers
                self._gather_header(END, DISABLING)
            self._check_headers()
        except Exception as exc:  # a mismatch, or the collective failed or timed out
            self.at.landed()
            self._pending, self._rebuilt = [], []
            raise DistributedOffloadError(
                f"handle.disable() cannot restore the exact weights of {self.at.names.what}: rank {self.rank} holds "
                f"only a shard of each block and rebuilding them with the other ranks failed ({exc}). Nothing was "
                "changed: the model is still offloaded; call disable() again on every rank once they are in step"
            ) from exc
        finally:
            self._disabling = False
            self._loaded_in_pass = -1  # the next forward's loads start a pass
        rebuilt, self._rebuilt = self._rebuilt, []
        self.policy.unshard(rebuilt)  # unpacked from here

    def _read_back(self, i: int, unit, reader) -> None:
        """Block ``i`` (``unit``) is in its slot for ``reader`` (after its gathers): copy it to new host buffers."""
        slot = self.at.ring.buffers_of(i)
        buffers = {dtype: torch.empty(n, dtype=dtype) for dtype, n in unit.numel.items()}
        with self._backend.batch(reader):
            for dtype, buf in buffers.items():
                self._backend.copy_async(buf, slot[dtype][: buf.numel()], reader)
        reader.synchronize()  # later copies into this slot are queued after this: ordered
        self._rebuilt.append(buffers)


def _read_flat(source: torch.Tensor, start: int, count: int, out: torch.Tensor) -> None:
    """A pageable shard read into the bounce ring."""
    out.copy_(source[start : start + count])
