"""Splitting a model into weight units: one per block, plus the resident rest.

A tensor belongs to a block's unit only if every module owning it, and every tensor sharing its
memory, lies in that one block. Anything shared across blocks, or between a block and the rest
of the model (a tied embedding, a shared rotary table), is resident: keeping one device copy is
both correct and cheaper than streaming duplicates.
"""

from __future__ import annotations

import logging
from typing import Sequence

from torch import nn

from .layout import storage_key
from .owners import collect_tensors
from .unit import WeightUnit

logger = logging.getLogger(__name__)

RESIDENT = -1


def split_units(root: nn.Module, blocks: Sequence[tuple[str, nn.Module]],
                report: bool = True) -> tuple[WeightUnit, list[WeightUnit]]:
    """(resident unit, one unit per block in order) for ``root`` streamed over ``blocks``;
    ``report``: log the blocks' tensors that stay resident, and warn of those that cannot be
    streamed (the strategy that streams them does; the planner, which only measures, does not say
    it a second time)."""
    home: dict[int, int] = {}  # module id -> block index, RESIDENT where it lies in several blocks
    for index, (_, block) in enumerate(blocks):
        for module in block.modules():
            home[id(module)] = index if home.get(id(module), index) == index else RESIDENT
    for module in _outside_blocks(root, {id(block) for _, block in blocks}):
        home[id(module)] = RESIDENT  # also reachable without entering a block: the model may call it anywhere
    tensors = collect_tensors([root])
    unit_of: dict[int, int] = {}
    for tid, (_, owners) in tensors.items():
        places = {home.get(id(o.module), RESIDENT) for o in owners}
        unit_of[tid] = places.pop() if len(places) == 1 else RESIDENT
    # tensors aliasing one storage must land in one unit
    by_storage: dict[tuple, set[int]] = {}
    for tid, (t, _) in tensors.items():
        by_storage.setdefault(storage_key(t), set()).add(tid)
    for tids in by_storage.values():
        if len({unit_of[t] for t in tids}) > 1:
            for t in tids:
                unit_of[t] = RESIDENT
    # tensors a block holds that stay resident all the same (not the rest of the model's own)
    in_blocks = {id(module) for _, block in blocks for module in block.modules()}
    shared = [
        owners[0].name for tid, (_, owners) in tensors.items()
        if unit_of[tid] == RESIDENT and any(id(o.module) in in_blocks for o in owners)
    ]
    if shared and report:
        logger.info("%d tensors of the blocks stay resident, not streamed, because they are shared across blocks or "
                    "with the rest of the model (one device copy serves every user): %s",
                    len(shared), ", ".join(shared[:8]) + (" ..." if len(shared) > 8 else ""))
    groups: dict[int, dict] = {index: {} for index in range(RESIDENT, len(blocks))}
    for tid, item in tensors.items():
        groups[unit_of[tid]][tid] = item
    resident = WeightUnit("resident", groups[RESIDENT], report)
    return resident, [WeightUnit(name, groups[i], report) for i, (name, _) in enumerate(blocks)]


def _outside_blocks(root: nn.Module, blocks: set[int]) -> list[nn.Module]:
    """The modules reachable from ``root`` without entering a block."""
    found, stack, seen = [], [root], set()
    while stack:
        module = stack.pop()
        if id(module) in seen or id(module) in blocks:
            continue
        seen.add(id(module))
        found.append(module)
        stack.extend(module.children())
    return found
