"""How a streamed block gets from its home into its slot: the transport of a layerwise part.

:class:`CopyTransport` copies the block's host home into the slot (straight from pinned or
pageable memory, or through the placement's bounce ring for a home without pinned memory or on
disk). :class:`RankCopy` does the same for a distributed part: its copies run on the copy stream
every distributed part of the process shares, so that collectives run in the same order on every
rank. The sharded transport (gather.py) copies this rank's shard and all-gathers the block across
ranks instead.

The layerwise part (layerwise.py) keeps the protocol (which block is where, when a slot may be
refilled, what a block shows) and does every load (its loader, loader.py); its home policy
(homes.py) decides what a home is and which changes it takes; the transport says what a load
issues, how a forward's changes go home and what the end of a pass must check. It is one-way: at
each enable, park and unpark the part hands it a frozen :class:`LoadContext` (the machinery it may
use), and where the transport needs blocks loaded (a failed rank's remaining gathers, disable's
rebuilding of shards) it says which, and the part's loader loads them. The one method it calls
back is the loader's ``landed`` (through the context): a transport that waited for the copy stream
says so. :class:`Transport` lists what the part calls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable, ContextManager, Iterable, Protocol

import torch

from .homes import BlockNames, no_ram_home
from .part import write_back

#: one copy stream per backend for every distributed part: collectives must run in the order they
#: were issued, which is the same on every rank, also when several DiTs stream (Wan2.2)
_COLLECTIVE_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True, eq=False)
class LoadContext:
    """What a layerwise part hands its transport at enable, park and unpark; dropped by ``release``."""

    backend: Any
    placement: Any
    copy_stream: Any
    ring: Any  # the SlotRing (ring.py); None while the part is parked
    landed: Callable[[], None]  # the part's loader's: every load queued so far has landed
    names: BlockNames


class Transport(Protocol):
    """What a layerwise part calls on its transport (``CopyTransport``, ``RankCopy``, ``ShardedGather``)."""

    strategy: str
    sharded: bool  # loads queued early carry a header the other ranks pair: the slots keep them

    def new_stream(self, backend) -> Any: ...
    def device_bytes(self, blocks: int, slots: int, slot_shape: dict[torch.dtype, int]) -> int: ...
    def serve(self, context: LoadContext) -> None: ...
    def allocate(self) -> None: ...
    def prepare_load(self, i: int, unit, slot: dict[torch.dtype, torch.Tensor]) -> tuple: ...
    def issue(self, record, stream) -> None: ...
    def preloading(self, blocks: Iterable[int]) -> None: ...
    def abort_pass(self) -> range: ...
    def aborted(self, i: int) -> ContextManager: ...
    def finish(self, failed: bool) -> None: ...
    def restoring(self) -> ContextManager: ...
    def read_back(self, i: int, reader) -> None: ...
    def agreed(self, serial: int) -> None: ...
    def release(self) -> None: ...


class CopyTransport:
    """Blocks loaded from their whole host home, on this process alone; see the module docstring."""

    sharded = False
    strategy = "layerwise"

    def __init__(self) -> None:
        self.at: LoadContext | None = None

    def serve(self, context: LoadContext) -> None:
        """Enable, park, unpark: what this transport may use from now until ``release``."""
        self.at = context
        self._backend, self._placement = context.backend, context.placement

    def new_stream(self, backend):
        return backend.new_stream()

    def device_bytes(self, blocks: int, slots: int, slot_shape: dict[torch.dtype, int]) -> int:
        """Device bytes beyond the slots and the resident weights."""
        return 0

    def allocate(self) -> None:
        """Device memory beyond the slots, once the ring exists."""

    # -- loads ------------------------------------------------------------------------------------
    def prepare_load(self, i: int, unit, slot: dict[torch.dtype, torch.Tensor]) -> tuple:
        """(transfers, copies, bytes, disk image, write-back) of a load of block ``i`` (``unit``)
        into ``slot``; the write-back says how a forward's changes to its tensors go home."""
        placement = self._placement
        transfers = placement.transfers(unit, slot)
        home = functools.partial(write_back, self._backend) if unit.host else functools.partial(self._no_home, i)
        return transfers, placement.copies(transfers), unit.nbytes, unit.image, home

    def _no_home(self, i: int, pairs) -> None:
        raise no_ram_home(self.at.names, i)

    def issue(self, record, stream) -> None:
        """Queue on ``stream`` what fills ``record``'s slot: one stream context for all of it. A
        block of one dtype from a host buffer is one copy, which selects its stream once itself:
        a batch around it would select nothing less and cost a context per block."""
        backend, placement = self._backend, self._placement
        transfers = record.transfers
        if placement.stager is None and len(transfers) == 1:
            backend.copy_async(*transfers[0], stream)
            return
        with backend.batch(stream):
            if placement.stager is None:  # every source is a host buffer: plain copies
                for dst, src in transfers:
                    backend.copy_async(dst, src, stream)
            else:
                placement.issue(transfers, stream)

    def preloading(self, blocks) -> None:
        """The next loads of ``blocks`` are queued early, inside ``frozen()``: only the sharded
        transport tells the other ranks."""

    # -- the ends of passes -----------------------------------------------------------------------
    def abort_pass(self) -> range:
        """This rank's forward failed before its end: the blocks the part loads still (none)."""
        return range(0)

    def aborted(self, i: int):
        """Around the part's load of block ``i`` after ``abort_pass``."""
        return contextlib.nullcontext()

    def finish(self, failed: bool) -> None:
        """The end of a pass, of a backward, or of a block called alone."""

    def restoring(self):
        """Disable, before the part unpacks: a context around the part's loads that give every unit
        its full host values, yielding the blocks to load (each then ``read_back``): none here."""
        return contextlib.nullcontext(())

    def read_back(self, i: int, reader) -> None:
        """Block ``i`` is in its slot for ``reader``: ``restoring`` yields none here."""

    def agreed(self, serial: int) -> None:
        """Every rank enabled alike; ``serial`` numbers this part the same on every rank."""

    def release(self) -> None:
        """Drop what ``allocate`` made, and what ``serve`` handed over."""
        self.at = None


class RankCopy(CopyTransport):
    """Blocks loaded from their whole host home, by one rank of a distributed part."""

    strategy = "distributed"

    def new_stream(self, backend):
        stream = _COLLECTIVE_STREAMS.get(backend)
        if stream is None:
            stream = _COLLECTIVE_STREAMS[backend] = backend.new_stream()
        return stream
