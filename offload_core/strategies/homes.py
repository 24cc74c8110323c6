"""Where a layerwise part's weights live between their loads, and which changes they take: its home policy.

A streamed block's *home* is what its tensors show outside its forward and what its loads copy
from. :class:`WholeHomePolicy` keeps each unit whole (pinned, pageable, or on disk with
placeholders shown in RAM); :class:`RankHomePolicy` does the same on one rank of a distributed
part, where a structural change must be refused on every rank alike; :class:`ShardHomePolicy`
keeps only this rank's shard of each block and shows placeholders. The policy packs the homes, says how much host memory
they take and what the slots' shape is, hooks what a home on disk or a shard cannot serve (a state
dict), says which blocks a user changed (``replaced``) and what the truth of each unit is.

It is apart from the transport (transport.py, gather.py), which says what a load issues: the
transport loads from homes and writes a forward's changes back into them, the policy decides what
they are. Each is handed at enable what it serves, frozen: the policy a :class:`PartWeights`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch
from tqdm.auto import tqdm

from ..base.errors import DistributedOffloadError, OffloadedModelError
from ..hostmem.placement import ONCE, STREAM, HostUnit
from ..weights.placeholders import placeholders
from .common import pack_units


@dataclasses.dataclass(frozen=True)
class BlockNames:
    """What messages and buffer labels call a part, its model and its streamed blocks."""

    what: str  # the model
    part: str  # the part (strategy and model), for buffer labels
    blocks: tuple[str, ...]

    def block(self, i: int) -> str:
        return f"block {self.blocks[i]} of {self.what}"


@dataclasses.dataclass(frozen=True, eq=False)
class PartWeights:
    """What a layerwise part hands its home policy at enable (and after a re-layout)."""

    model: Any
    blocks: tuple  # the streamed blocks
    names: BlockNames
    resident: Any  # the resident WeightUnit
    units: tuple  # one WeightUnit per streamed block
    kept: tuple  # one WeightUnit per kept block (held whole, never streamed)

    @classmethod
    def of(cls, part) -> "PartWeights":
        """A layerwise part's weights as they are now (its blocks are split anew by a re-layout)."""
        names = BlockNames(part.describe(), part.name, tuple(part.block_names))
        return cls(part.model, tuple(part.blocks), names, part.resident, tuple(part.units), tuple(part.kept_units))


def no_ram_home(names: BlockNames, i: int) -> OffloadedModelError:
    """The error for a change to block ``i``, whose home is on disk: no host copy to take it."""
    return OffloadedModelError(
        f"{names.block(i)} has its home on disk (a host_memory budget): "
        "it has no host copy to change. Call handle.disable() first, or give it RAM"
    )


class WholeHomePolicy:
    """Each unit's home is the whole unit, in RAM or on disk; see the module docstring."""

    def __init__(self) -> None:
        self.at: PartWeights | None = None

    def serve(self, weights: PartWeights) -> None:
        self.at = weights

    # -- sizes --------------------------------------------------------------------------------
    def slot_shape(self, shape: dict[torch.dtype, int]) -> dict[torch.dtype, int]:
        return shape

    def host_units(self, resident, units) -> list:
        return [HostUnit(resident, ONCE, resident.nbytes), *(HostUnit(u, STREAM, u.nbytes) for u in units)]

    def host_bytes(self, units) -> int:
        return sum(u.nbytes for u in units)

    # -- the homes ----------------------------------------------------------------------------
    def pack(self, placement, txn) -> None:
        """Give every unit its host home (the whole unit, one buffer per dtype)."""
        at = self.at
        pack_units([at.resident, *at.kept, *at.units], placement, txn, at.names.what)
        show_placeholders_on_disk([at.resident, *at.kept, *at.units])

    def instrument(self) -> list:
        """Hooks beyond the block wrappers (removed with them): a block whose home is on disk
        has its state dict read from there, and refuses one loaded into it."""
        at, hooks = self.at, []
        for i, unit in enumerate(at.units):
            if unit.image is None:
                continue
            block = at.blocks[i]
            hooks.append(block.register_state_dict_pre_hook(functools.partial(_show_home, unit)))
            hooks.append(block.register_state_dict_post_hook(functools.partial(_show_placeholders, unit)))
            refuse = functools.partial(_refuse_loading, at.names.block(i))
            hooks.extend(module.register_load_state_dict_pre_hook(refuse) for module in block.modules())
        return hooks

    def truth(self) -> list:
        """(unit, views its owners show, buffers holding its true values) per streamed unit
        with a home (read from disk for a home there)."""
        return [(u, u.host_views, u.home()) for u in self.at.units if u.host or u.image]

    # -- the user's changes -------------------------------------------------------------------
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
                    raise no_ram_home(self.at.names, i)
                yield i

    def unchanged(self, homes) -> bool:
        """Before a pass: True if nothing the pass must take in first changed. On one process the
        buffers alone: each block's parameters are checked as it binds (``Checks.retake``),
        which takes in what changed since, and runs a parameter given data of another layout on a
        device copy of it for that call, re-packing before the next."""
        return homes.buffers_at_home()

    def repack_refusal(self) -> Exception | None:
        return None

    def untrainable(self, i: int) -> Exception:
        return no_ram_home(self.at.names, i)

    def release(self) -> None:
        self.at = None


class RankHomePolicy(WholeHomePolicy):
    """Whole homes on one rank of a distributed part: every rank must hold and change them alike."""

    sharded = False

    def __init__(self, ranks: Any) -> None:
        super().__init__()
        self.ranks = ranks  # a distributed.Ranks
        self.fingerprints: tuple | list = ()  # of each block's weights, when ranks must hold the same ones

    def unchanged(self, homes) -> bool:
        """Every tensor, before any collective of the pass: a structural change must be refused
        on every rank before it starts (``repack_refusal``), not found as a block binds."""
        return homes.at_home()

    def repack_refusal(self) -> Exception | None:
        """Across ranks a part cannot be packed again alone: the others would not follow."""
        return DistributedOffloadError(
            f"the structure of {self.at.names.what} changed while it is offloaded across ranks (a dtype change, "
            "a new module or a replaced tensor): call the collective handle.disable() on every rank first"
        )

    def layout(self, strategy: str) -> tuple:
        """What every rank must have packed alike (see distributed.Agreement)."""
        at = self.at
        units = [at.resident, *at.kept, *at.units]
        sizes = tuple(tuple(sorted((str(d), n) for d, n in u.numel.items())) for u in units)
        return (strategy, self.sharded, self.ranks.world, at.names.blocks, sizes, tuple(self.fingerprints))


def padded(n: int, world: int) -> int:
    return -(-n // world) * world


class ShardHomePolicy(RankHomePolicy):
    """Each block's home is this rank's shard of it: its per-dtype buffer padded to a multiple of
    the world size and cut into N equal shards, shard r kept by rank r (see gather.py). Outside
    their forward the blocks show placeholders; no rank can produce or take a full state dict."""

    sharded = True

    def __init__(self, ranks: Any) -> None:
        super().__init__(ranks)
        self.world, self.rank = ranks.world, ranks.rank
        self.shards: list[dict[torch.dtype, torch.Tensor]] = []
        self.fingerprints: list[tuple[int, ...]] = []

    def slot_shape(self, shape):
        return {dtype: padded(n, self.world) for dtype, n in shape.items()}

    def _shard_buffers(self, unit) -> tuple[int, ...]:
        return tuple(padded(n, self.world) // self.world * dtype.itemsize for dtype, n in unit.numel.items())

    def host_units(self, resident, units) -> list:
        return [HostUnit(resident, ONCE, resident.nbytes),
                *(HostUnit(u, STREAM, sum(self._shard_buffers(u)), self._shard_buffers(u)) for u in units)]

    def host_bytes(self, units) -> int:
        return sum(sum(self._shard_buffers(u)) for u in units)

    def pack(self, placement, txn) -> None:
        """Keep only this rank's shard of each block, building one block's padded copy at a time;
        outside their forward the blocks show placeholders. The undo log keeps the original
        tensors until enable succeeds, so a failure can put them back untouched."""
        at = self.at
        pack_units([at.resident, *at.kept], placement, txn, "resident weights")
        show_placeholders_on_disk(at.kept)
        self.shards, self.fingerprints = [], []
        for unit in tqdm(at.units, desc=f"sharding blocks (rank {self.rank} of {self.world})", disable=None,
                         leave=False):
            txn.on_rollback(functools.partial(_rebind_all, unit.originals()))
            self.shards.append(self._shard(unit, placement))
            unit.keep_on(placement.backend.device())
            unit.host_views = placeholders(unit)
            unit.bind(unit.host_views)

    def _shard(self, unit, placement) -> dict[torch.dtype, torch.Tensor]:
        """This rank's shard of ``unit``, per dtype, and its fingerprint; the padded copy they are
        cut from dies on return."""
        full = unit.take(lambda n, dtype: torch.zeros(padded(n, self.world), dtype=dtype))
        self.fingerprints.append(fingerprint(full))
        allocate = placement.allocator(unit)
        shards = {}
        for dtype, buffer in full.items():
            size = buffer.numel() // self.world
            shards[dtype] = allocate(size, dtype)
            shards[dtype].copy_(buffer[self.rank * size : (self.rank + 1) * size])
        return shards

    def unshard(self, rebuilt: list) -> None:
        """``rebuilt``: every streamed unit's full host buffers, gathered from the ranks' shards at
        disable; they are the units' homes from here (their owners still show placeholders)."""
        for unit, buffers in zip(self.at.units, rebuilt):
            unit.host = buffers
        self.shards = []

    def instrument(self) -> list:
        """A rank can neither produce nor take a full state dict: refused at every module."""
        at = self.at
        refuse = functools.partial(_refuse_state_dict, at.names.what)
        modules = {id(m): m for b in at.blocks for m in b.modules()}
        modules[id(at.model)] = at.model
        hooks = []
        for module in modules.values():
            hooks.append(module.register_state_dict_pre_hook(refuse))
            hooks.append(module.register_load_state_dict_pre_hook(refuse))
        return hooks

    def replaced(self, blocks, records, homes, dirty: bool, before_pass: bool):
        """A rank holds only shards: any change to a block's tensors is refused."""
        at = self.at
        changed = [f"{at.names.blocks[i]}:{owner.name}" for i in blocks
                   for _, owner in at.units[i].foreign(at.units[i].host_views)]
        changed += [f"{at.names.blocks[i]} (changed in place)" for i in blocks if records[i].binding.touched()]
        if changed or dirty:
            raise DistributedOffloadError(
                f"tensors of {at.names.what} were replaced while its blocks are sharded across ranks "
                f"({', '.join(changed[:4]) or 'a module or tensor was added'}); a rank holds only a shard of "
                "each block, so changes need the collective handle.disable() first"
            )
        return iter(())

    def untrainable(self, i: int) -> Exception:
        return DistributedOffloadError(
            f"weights of {self.at.names.block(i)} require grad, but each rank holds only "
            "a shard of them: freeze them (requires_grad_(False)), or enable with shard_host_weights=False to train them"
        )

    def truth(self) -> list:
        raise DistributedOffloadError(
            "this rank holds only a shard of each block: copying or pickling the model needs the "
            "collective handle.disable() first, which rebuilds the full weights on every rank"
        )


def show_placeholders_on_disk(units) -> None:
    """A unit whose home is on disk has no host memory to show while it is not on the device."""
    for unit in units:
        if unit.image is not None:
            unit.host_views = placeholders(unit)
            unit.bind(unit.host_views)


def fingerprint(buffers: dict[torch.dtype, torch.Tensor]) -> tuple[int, ...]:
    """A cheap digest of a unit's bytes: sums of its words, and of every other word, per dtype.
    Two ranks holding different weights for one block get different digests."""
    digest = []
    for dtype in sorted(buffers, key=str):
        raw = buffers[dtype].reshape(-1).view(torch.uint8)
        words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
        digest += [int(words.sum(dtype=torch.int64)), int(words[::2].sum(dtype=torch.int64))]
    return tuple(digest)


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


def _rebind_all(originals) -> None:
    for owner, tensor in originals:
        if owner.param is not None and owner.param.is_meta != tensor.is_meta:
            owner.replace(torch.nn.Parameter(tensor, requires_grad=owner.param.requires_grad))
        else:
            owner.rebind(tensor)


def _refuse_state_dict(name: str, module, *args) -> None:
    raise DistributedOffloadError(
        f"this rank holds only a shard of each block of {name}: a state dict (saving or loading) needs the "
        "collective handle.disable() first, which rebuilds the full weights on every rank"
    )
