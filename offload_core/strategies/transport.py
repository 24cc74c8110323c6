"""How a streamed block gets from its home into its slot: the transport of a layerwise part.

:class:`CopyTransport` copies the block's host home into the slot (straight from pinned or
pageable memory, or through the placement's bounce ring for a home without pinned memory or on
disk). :class:`RankCopy` does the same for a distributed part: its copies run on the copy stream
every distributed part of the process shares (``collective``), so that collectives run in the same
order on every rank. The sharded transport (gather.py) copies this rank's shard and all-gathers
the block across ranks instead.

The layerwise part (layerwise.py) keeps the protocol (which block is where, when a slot may be
refilled, what a block shows) and does every load (its loader, loader.py); its home policy
(homes.py) decides what a home is and which changes it takes; the transport says what a load
issues and how a forward's changes go home. It is one-way: at each enable, park and unpark the
part hands it a frozen :class:`LoadContext` (the machinery it may use), and the one method it
calls back is the loader's ``landed`` (through the context): a transport that waited for the copy
stream says so. :class:`Transport` lists what the part calls on every transport.

A sharded transport's loads pair with the other ranks' loads, so the part also tells it where
passes end, which loads are queued early and when the ranks agreed, and has it rebuild the full
weights at disable: :class:`RankPairing`, which only the sharded gather is (a transport's
``pairing``; None for a copy, whose loads pair with nothing). Where it needs blocks loaded (a
failed rank's remaining gathers, disable's rebuilding) it is handed the part's load and calls it.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import Any, Callable, Iterable, Protocol

import torch

from .homes import BlockNames, no_ram_home
from .part import write_back

#: one copy stream per backend for every distributed part: collectives must run in the order they
#: were issued, which is the same on every rank, also when several DiTs stream (Wan2.2)
_COLLECTIVE_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(frozen=True, eq=False)
class LoadContext:
    """What a layerwise part hands its transport at enable, park and unpark (``serve``)."""

    backend: Any
    placement: Any
    copy_stream: Any
    ring: Any  # the SlotRing (ring.py); None while the part is parked
    landed: Callable[[], None]  # the part's loader's: every load queued so far has landed
    names: BlockNames


def copy_stream(backend, collective: bool):
    """A part's copy stream: its own, or (``collective``) the one every distributed part of the
    process shares for ``backend``."""
    if not collective:
        return backend.new_stream()
    stream = _COLLECTIVE_STREAMS.get(backend)
    if stream is None:
        stream = _COLLECTIVE_STREAMS[backend] = backend.new_stream()
    return stream


class Transport(Protocol):
    """What a layerwise part calls on its transport (``CopyTransport``, ``RankCopy``, ``ShardedGather``)."""

    strategy: str
    collective: bool  # its copies run on the process's one stream for collectives (``copy_stream``)
    pairing: "RankPairing | None"  # what keeps the ranks in step, where loads pair across ranks

    def device_bytes(self, blocks: int, slots: int, slot_shape: dict[torch.dtype, int]) -> int: ...
    def serve(self, context: LoadContext | None) -> None: ...
    def prepare_load(self, i: int, unit, slot: dict[torch.dtype, torch.Tensor]) -> tuple: ...
    def issue(self, record, stream) -> None: ...


class RankPairing(Protocol):
    """What a part whose loads pair with the other ranks' (the sharded gather) calls besides."""

    def agreed(self, serial: int) -> None: ...
    def preloading(self, blocks: Iterable[int]) -> None: ...
    def end_pass(self, failed: bool, load: Callable[[int], None] | None = None) -> None: ...
    def restore(self, fetch: Callable[[int], Any], reader) -> None: ...


class CopyTransport:
    """Blocks loaded from their whole host home, on this process alone; see the module docstring."""

    strategy = "layerwise"
    collective = False
    pairing = None

    def __init__(self) -> None:
        self.at: LoadContext | None = None

    def serve(self, context: LoadContext | None) -> None:
        """Enable, park, unpark: what this transport may use from now on (None: nothing, at
        disable or a rolled-back enable)."""
        self.at = context
        self._backend, self._placement = (context.backend, context.placement) if context else (None, None)

    def device_bytes(self, blocks: int, slots: int, slot_shape: dict[torch.dtype, int]) -> int:
        """Device bytes beyond the slots and the resident weights."""
        return 0

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


class RankCopy(CopyTransport):
    """Blocks loaded from their whole host home, by one rank of a distributed part."""

    strategy = "distributed"
    collective = True
