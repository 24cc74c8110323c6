"""How a streamed block gets from its home into its slot: the transport of a layerwise part.

:class:`CopyTransport` copies the block's host home into the slot (straight from pinned or
pageable memory, or through the placement's bounce ring for a home without pinned memory or on
disk). The sharded transport (gather.py) copies this rank's shard and all-gathers the block
across ranks instead. The layerwise part (layerwise.py) keeps the protocol (which block is where,
when a slot may be refilled, what a block shows); the transport decides what a home is, what a
load issues, and what the end of a pass must check. A transport given ``ranks`` serves a
distributed part: its copies run on the copy stream every distributed part of the process
shares, so that collectives run in the same order on every rank.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ..errors import DistributedOffloadError, OffloadedModelError
from ..hostmem.placement import ONCE, STREAM, HostUnit
from .common import pack_units
from .part import write_back

#: one copy stream per backend for every distributed part: collectives must run in the order they
#: were issued, which is the same on every rank, also when several DiTs stream (Wan2.2)
_COLLECTIVE_STREAMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class CopyTransport:
    """Blocks loaded from their whole host home; see the module docstring."""

    sharded = False
    fingerprints: tuple | list = ()  # of each block's weights, when ranks must hold the same ones

    def __init__(self, ranks: Any = None) -> None:
        self.ranks = ranks  # a distributed.Ranks, or None
        self._part: Any = None

    @property
    def part(self) -> Any:
        """The layerwise part this transport serves (held weakly: disable frees the part at once)."""
        return self._part()

    def serve(self, part) -> None:
        self._part = weakref.ref(part)

    @property
    def strategy(self) -> str:
        return "layerwise" if self.ranks is None else "distributed"

    # -- sizes and homes ------------------------------------------------------------------------
    def slot_shape(self, shape: dict[torch.dtype, int]) -> dict[torch.dtype, int]:
        return shape

    def host_units(self) -> list:
        part = self.part
        return [HostUnit(part.resident, ONCE, part.resident.nbytes),
                *(HostUnit(u, STREAM, u.nbytes) for u in part.units)]

    def host_bytes(self) -> int:
        return sum(u.nbytes for u in self.part.units)

    def device_bytes(self) -> int:
        """Device bytes beyond the slots and the resident weights."""
        return 0

    def new_stream(self, backend):
        if self.ranks is None:
            return backend.new_stream()
        stream = _COLLECTIVE_STREAMS.get(backend)
        if stream is None:
            stream = _COLLECTIVE_STREAMS[backend] = backend.new_stream()
        return stream

    def pack(self, txn) -> None:
        """Give every unit its host home (the whole unit, one buffer per dtype)."""
        part = self.part
        pack_units([part.resident, *part.units], part.placement, txn, type(part.model).__name__)
        for unit in part.units:  # a home on disk has no host memory to show outside the forward
            if unit.image is not None:
                unit.host_views = placeholders(unit)
                unit.bind(unit.host_views)

    def allocate(self) -> None:
        """Device memory beyond the slots, once the ring exists."""

    def instrument(self) -> list:
        """Hooks beyond the block wrappers (removed with them): a block whose home is on disk
        has its state dict read from there, and refuses one loaded into it."""
        part, hooks = self.part, []
        for i, unit in enumerate(part.units):
            if unit.image is None:
                continue
            block, what = part.blocks[i], f"block {part.block_names[i]} of {part.describe()}"
            hooks.append(block.register_state_dict_pre_hook(functools.partial(_show_home, unit)))
            hooks.append(block.register_state_dict_post_hook(functools.partial(_show_placeholders, unit)))
            refuse = functools.partial(_refuse_loading, what)
            hooks.extend(module.register_load_state_dict_pre_hook(refuse) for module in block.modules())
        return hooks

    # -- loads ------------------------------------------------------------------------------------
    def plan(self, i: int, unit, slot: dict[torch.dtype, torch.Tensor]) -> tuple[list, int, int, Any]:
        """(transfers, copies, bytes, disk image) of a load of block ``i`` (``unit``) into ``slot``."""
        placement = self.part.placement
        transfers = placement.transfers(unit, slot)
        return transfers, placement.copies(transfers), unit.nbytes, unit.image

    def issue(self, plan, stream) -> None:
        """Queue on ``stream`` what fills ``plan``'s slot: one stream context for all of it."""
        part = self._part()  # once per block: not through the property
        backend = part.backend
        with backend.batch(stream):
            if part.placement.stager is None:  # every source is a host buffer: plain copies
                for dst, src in plan.transfers:
                    backend.copy_async(dst, src, stream)
            else:
                part.placement.issue(plan.transfers, stream)

    def preloading(self, blocks) -> None:
        """The next loads of ``blocks`` are queued early, inside ``frozen()``: only the sharded
        transport tells the other ranks."""

    def write_back(self, i: int):
        """How a forward's changes to block ``i``'s tensors go home (asked once per block plan)."""
        part = self.part
        if not part.units[i].host:
            return functools.partial(self._no_ram_home, i)
        return functools.partial(write_back, part.backend)

    def _no_ram_home(self, i: int, pairs) -> None:
        raise self.part.no_ram_home(i)

    # -- keeping the model in step ----------------------------------------------------------------
    def replaced(self, blocks):
        """(unit, home views) of each of ``blocks`` whose owners no longer all show their home
        views, for ``Part.reconcile``; once the copies queued earlier (which read the host as it
        was) are done. A block with no home in RAM cannot take a change."""
        part = self.part
        if len(blocks) == len(part.plans) and part.homes.at_home():  # the rule, before each pass: one check
            return
        for i in blocks:
            plan = part.plans[i]
            if not plan.binding.at_home():
                if not plan.unit.host:
                    raise part.no_ram_home(i)
                part.quiesce()
                yield plan.unit, part.home_views(i)

    def repack_refusal(self) -> Exception | None:
        """Across ranks a part cannot be packed again alone: the others would not follow."""
        if self.ranks is None:
            return None
        return DistributedOffloadError(
            f"the structure of {self.part.describe()} changed while it is offloaded across ranks (a dtype change, "
            "a new module or a replaced tensor): call the collective handle.disable() on every rank first"
        )

    def abort_pass(self) -> None:
        """This rank's forward failed before its end."""

    def finish(self, failed: bool) -> None:
        """The end of a pass, of a backward, or of a block called alone."""

    def untrainable(self, i: int) -> Exception:
        return self.part.no_ram_home(i)

    def truth(self) -> list:
        """(unit, views its owners show, buffers holding its true values) per streamed unit
        with a home (read from disk for a home there)."""
        part = self.part
        return [(u, part.home_views(i), u.home()) for i, u in enumerate(part.units) if u.host or u.image]

    def restore(self) -> None:
        """Before ``disable`` unpacks: every unit has its full host values."""

    def release(self) -> None:
        """Drop what ``allocate`` made."""

    def layout(self) -> tuple:
        """What every rank must have packed alike (see distributed.Agreement)."""
        part = self.part
        units = [part.resident, *part.units]
        sizes = tuple(tuple(sorted((str(d), n) for d, n in u.numel.items())) for u in units)
        return (self.strategy, self.sharded, self.ranks.world, tuple(part.block_names), sizes,
                tuple(self.fingerprints))

    def agreed(self, serial: int) -> None:
        """Every rank enabled alike; ``serial`` numbers this part the same on every rank."""


def placeholders(unit) -> list[torch.Tensor]:
    """What a block with no home in RAM (on disk, or a rank's shard) shows outside its forward:
    host tensors of the right shape and dtype, every element NaN (integers: their maximum,
    booleans: True) through one element of memory (all strides 0). Computing with them gives NaN
    on a CPU and a device-mismatch error on an accelerator, never another block's weights; writing
    into them raises (their elements overlap)."""
    poison = {}
    for dtype in unit.numel:
        if dtype.is_floating_point or dtype.is_complex:
            value = float("nan")
        elif dtype == torch.bool:
            value = True
        else:
            value = torch.iinfo(dtype).max
        poison[dtype] = torch.full((), value, dtype=dtype)
    return [poison[e.dtype].expand(e.size) for e in unit.entries]


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
