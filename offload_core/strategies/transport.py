"""How a streamed block gets from its home into its slot: the transport of a layerwise part.

:class:`CopyTransport` copies the block's host home into the slot (straight from pinned or
pageable memory, or through the placement's bounce ring for a home without pinned memory or on
disk). :class:`RankCopy` does the same for a distributed part: its copies run on the copy stream
every distributed part of the process shares, so that collectives run in the same order on every
rank, and a structural change is refused. The sharded transport (gather.py) copies this rank's
shard and all-gathers the block across ranks instead.

The layerwise part (layerwise.py) keeps the protocol (which block is where, when a slot may be
refilled, what a block shows) and does every load (its loader, loader.py); the transport decides
what a home is, what a load issues, and what the end of a pass must check. It is one-way: at
each enable the part hands it a :class:`Served` (what it serves and the machinery it may use),
and where the transport needs blocks loaded (a failed rank's remaining gathers, disable's
rebuilding of shards) it says which, and the part's loader loads them. The one method it calls
back is the loader's ``landed`` (through ``Served``): a transport that waited for the copy
stream says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from typing import Any, Callable

import torch

from ..errors import DistributedOffloadError, OffloadedModelError
from ..hostmem.placement import ONCE, STREAM, HostUnit
from ..weights.placeholders import placeholders
from .common import pack_units
from .part import write_back

#: one copy stream per backend for every distributed part: collectives must run in the order they
#: were issued, which is the same on every rank, also when several DiTs stream (Wan2.2)
_COLLECTIVE_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclasses.dataclass(eq=False)
class Served:
    """What a layerwise part hands its transport at enable; dropped again by ``release``."""

    backend: Any
    placement: Any
    copy_stream: Any
    ring: Any  # the SlotRing (ring.py)
    model: Any
    blocks: list
    block_names: list[str]
    resident: Any  # the resident WeightUnit
    units: list  # one WeightUnit per streamed block
    what: str  # the model, for messages
    name: str  # the part, for buffer labels
    landed: Callable[[], None]  # the part's loader's: every load queued so far has landed
    kept: list = dataclasses.field(default_factory=list)  # one WeightUnit per kept block (held whole, never streamed)


class CopyTransport:
    """Blocks loaded from their whole host home, on this process alone; see the module docstring."""

    sharded = False
    strategy = "layerwise"

    def __init__(self) -> None:
        self.at: Served | None = None

    def serve(self, served: Served) -> None:
        """Enable: what this transport serves from now until ``release``."""
        self.at = served
        self._backend, self._placement = served.backend, served.placement

    # -- sizes and homes ------------------------------------------------------------------------
    def slot_shape(self, shape: dict[torch.dtype, int]) -> dict[torch.dtype, int]:
        return shape

    def host_units(self, resident, units) -> list:
        return [HostUnit(resident, ONCE, resident.nbytes), *(HostUnit(u, STREAM, u.nbytes) for u in units)]

    def host_bytes(self, units) -> int:
        return sum(u.nbytes for u in units)

    def device_bytes(self, units, slots: int, slot_shape: dict[torch.dtype, int]) -> int:
        """Device bytes beyond the slots and the resident weights."""
        return 0

    def new_stream(self, backend):
        return backend.new_stream()

    def pack(self, txn) -> None:
        """Give every unit its host home (the whole unit, one buffer per dtype)."""
        at = self.at
        pack_units([at.resident, *at.kept, *at.units], at.placement, txn, type(at.model).__name__)
        show_placeholders_on_disk([at.resident, *at.kept, *at.units])

    def allocate(self) -> None:
        """Device memory beyond the slots, once the ring exists."""

    def instrument(self) -> list:
        """Hooks beyond the block wrappers (removed with them): a block whose home is on disk
        has its state dict read from there, and refuses one loaded into it."""
        at, hooks = self.at, []
        for i, unit in enumerate(at.units):
            if unit.image is None:
                continue
            block, what = at.blocks[i], f"block {at.block_names[i]} of {at.what}"
            hooks.append(block.register_state_dict_pre_hook(functools.partial(_show_home, unit)))
            hooks.append(block.register_state_dict_post_hook(functools.partial(_show_placeholders, unit)))
            refuse = functools.partial(_refuse_loading, what)
            hooks.extend(module.register_load_state_dict_pre_hook(refuse) for module in block.modules())
        return hooks

    # -- loads ------------------------------------------------------------------------------------
    def prepare_load(self, i: int, unit, slot: dict[torch.dtype, torch.Tensor]) -> tuple[list, int, int, Any]:
        """(transfers, copies, bytes, disk image) of a load of block ``i`` (``unit``) into ``slot``."""
        placement = self._placement
        transfers = placement.transfers(unit, slot)
        return transfers, placement.copies(transfers), unit.nbytes, unit.image

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

    def write_back(self, i: int):
        """How a forward's changes to block ``i``'s tensors go home (asked once per load record)."""
        if not self.at.units[i].host:
            return functools.partial(self._no_ram_home, i)
        return functools.partial(write_back, self._backend)

    def _no_ram_home(self, i: int, pairs) -> None:
        raise self.no_ram_home(i)

    def no_ram_home(self, i: int) -> Exception:
        """The error for a change to block ``i``, which has no home in RAM to take it."""
        return OffloadedModelError(
            f"block {self.at.block_names[i]} of {self.at.what} has its home on disk (a host_memory budget): "
            "it has no host copy to change. Call handle.disable() first, or give it RAM"
        )

    # -- keeping the model in step ----------------------------------------------------------------
    def replaced(self, blocks, records, homes, dirty: bool, before_pass: bool):
        """Each of ``blocks`` whose owners no longer all show their home views, for
        ``Part.reconcile`` (the part waits for the copies queued earlier, which read the host as it
        was, before it takes each). A block with no home in RAM cannot take a change.
        ``before_pass``: ``blocks`` are every block, checked before a pass, first all at once
        (``unchanged``)."""
        if before_pass and self.unchanged(homes):  # the rule: one check
            return
        for i in blocks:
            record = records[i]
            if not record.binding.at_home():
                if not record.unit.host:
                    raise self.no_ram_home(i)
                yield i

    def unchanged(self, homes) -> bool:
        """Before a pass: True if nothing the pass must take in first changed. On one process the
        buffers alone: each block's parameters are checked as it binds (``Checks.retake``),
        which takes in what changed since, and runs a parameter given data of another layout on a
        device copy of it for that call, re-packing before the next."""
        return homes.buffers_at_home()

    def repack_refusal(self) -> Exception | None:
        return None

    def abort_pass(self) -> range:
        """This rank's forward failed before its end: the blocks the part loads still (none)."""
        return range(0)

    def aborted(self, i: int):
        """Around the part's load of block ``i`` after ``abort_pass``."""
        return contextlib.nullcontext()

    def finish(self, failed: bool) -> None:
        """The end of a pass, of a backward, or of a block called alone."""

    def untrainable(self, i: int) -> Exception:
        return self.no_ram_home(i)

    def truth(self) -> list:
        """(unit, views its owners show, buffers holding its true values) per streamed unit
        with a home (read from disk for a home there)."""
        return [(u, u.host_views, u.home()) for u in self.at.units if u.host or u.image]

    def restoring(self):
        """Disable, before the part unpacks: a context around the part's loads that give every unit
        its full host values, yielding the blocks to load (each then ``read_back``): none here."""
        return contextlib.nullcontext(())

    def release(self) -> None:
        """Drop what ``allocate`` made, and what ``serve`` handed over."""
        self.at = None


class RankCopy(CopyTransport):
    """Blocks loaded from their whole host home, by one rank of a distributed part."""

    strategy = "distributed"

    def __init__(self, ranks: Any) -> None:
        super().__init__()
        self.ranks = ranks  # a distributed.Ranks
        self.fingerprints: tuple | list = ()  # of each block's weights, when ranks must hold the same ones

    def new_stream(self, backend):
        stream = _COLLECTIVE_STREAMS.get(backend)
        if stream is None:
            stream = _COLLECTIVE_STREAMS[backend] = backend.new_stream()
        return stream

    def unchanged(self, homes) -> bool:
        """Every tensor, before any collective of the pass: a structural change must be refused
        on every rank before it starts (``repack_refusal``), not found as a block binds."""
        return homes.at_home()

    def repack_refusal(self) -> Exception | None:
        """Across ranks a part cannot be packed again alone: the others would not follow."""
        return DistributedOffloadError(
            f"the structure of {self.at.what} changed while it is offloaded across ranks (a dtype change, "
            "a new module or a replaced tensor): call the collective handle.disable() on every rank first"
        )

    def layout(self) -> tuple:
        """What every rank must have packed alike (see distributed.Agreement)."""
        at = self.at
        units = [at.resident, *at.kept, *at.units]
        sizes = tuple(tuple(sorted((str(d), n) for d, n in u.numel.items())) for u in units)
        return (self.strategy, self.sharded, self.ranks.world, tuple(at.block_names), sizes,
                tuple(self.fingerprints))

    def agreed(self, serial: int) -> None:
        """Every rank enabled alike; ``serial`` numbers this part the same on every rank."""


def show_placeholders_on_disk(units) -> None:
    """A unit whose home is on disk has no host memory to show while it is not on the device."""
    for unit in units:
        if unit.image is not None:
            unit.host_views = placeholders(unit)
            unit.bind(unit.host_views)


def _show_home(unit, module, prefix: str, keep_vars: bool) -> None:
    """While its state dict is taken, a block whose home is on disk shows its values read from
    there (so that modules with their own ``_save_to_state_dict``, optimum-quanto's, read them too)."""
    unit.bind(unit.views(unit.home()))


def _show_placeholders(unit, module, state_dict: dict, prefix: str, local_metadata) -> None:
    unit.bind(unit.host_views)


def _refuse_loading(what: str, module, *args) -> None:
    raise OffloadedModelError(
        f"{what} has its home on disk and no host copy to load a state dict into: call handle.disable() first"
    )
