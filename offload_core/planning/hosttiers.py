"""The host side of a plan: which of each component's bytes are pinned, pageable or on disk.

The tiers come from the placement policy itself (``offload_core.hostmem.placement``: resident
weights stay in RAM; blocks follow, those streamed every step first, then a text encoder's, then
the blocks kept on the device, read once per phase switch; the rest go to disk; pinned memory goes
first to the bounce ring when anything is staged, then to what is copied most often), applied to
byte counts instead of packed units, so the plan says what ``enable_offload`` will do.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ..common.config import parse_budget
from .components import Component
from .plan import RESIDENT, STAGED, SWAPPED, ComponentPlan

TIER_NAMES = ("pinned", "pageable", "disk")
NO_BUDGET_NOTE = ("no host budget given: every host byte is counted as pinned (the default pinned budget, half "
                  "of RAM, may pin less; see docs/bigger-than-ram.md)")
#: what "disk" takes: blocks there are read from the checkpoint of the component they belong to
DISK_NOTE = ("{components}: blocks on disk are read from the component's own checkpoint every time they run, "
             "when the pipeline or model is loaded with offload_core.from_pretrained (text encoders included); a "
             "model already in memory needs offload_folder= to spill them to (see docs/bigger-than-ram.md)")


def _units(part: ComponentPlan, component: Component, world_size: int) -> list[tuple[str, int, int | None]]:
    """``(role, bytes, block)`` of the host units the strategies make of a component under ``part``
    (``block``: the block a unit holds, None for the resident weights or the whole component)."""
    from ..hostmem.placement import ONCE, PROMPT, STREAM, SWAP, SWITCH

    if part.mode in (STAGED, SWAPPED):
        return [(SWAP, component.total_bytes, None)]
    if part.mode == RESIDENT:  # one unit, copied to the device once
        return [(ONCE, component.total_bytes, None)]
    # a part that parks reads its resident weights back once per switch too
    units = [(SWITCH if part.parks else ONCE, component.resident_bytes, None)]
    units += [(SWITCH, component.block_bytes[i], i) for i in part.resident_blocks]
    role = STREAM if component.kind == "dit" else PROMPT  # as enable marks the parts it builds
    return units + [(role, component.block_bytes[i] // world_size, i) for i in part.streamed_blocks]


def host_tiers(parts: Sequence[ComponentPlan], components: Sequence[Component], host_memory: object,
               pinned_memory: object, world_size: int = 1) -> tuple[list[ComponentPlan], str | None]:
    """``parts`` with their ``host`` bytes filled in, and a note for the plan (or None)."""
    by_name = {c.name: c for c in components}
    if host_memory is None and pinned_memory is None:
        filled = [dataclasses.replace(p, host={"pinned": sum(b for _, b, _ in _units(p, by_name[p.name], world_size))},
                                      disk_blocks=()) for p in parts]
        return filled, NO_BUDGET_NOTE
    from ..hostmem.machine import AUTO_PINNED_SHARE, physical_memory
    from ..hostmem.placement import HostUnit, Tier, _assign, ring_reserve

    owned = [(p.name, block, HostUnit(object(), role, nbytes, (nbytes,)))
             for p in parts for role, nbytes, block in _units(p, by_name[p.name], world_size)]
    units = [u for _, _, u in owned]
    host = parse_budget(host_memory).resolve(physical_memory())
    pinned = parse_budget(pinned_memory).resolve(physical_memory())
    if pinned is None:
        pinned = int(AUTO_PINNED_SHARE * physical_memory())
    # as place_homes does: the bounce ring takes its pinned share only when something is staged
    tiers = _assign(units, True, host, pinned, reserve=0)
    if any(t in (Tier.STAGED, Tier.DISK) for t in tiers.values()):
        largest = max(u.nbytes for u in units)
        tiers = _assign(units, True, host, pinned, reserve=ring_reserve(largest, disk=True))
        if not any(t is Tier.DISK for t in tiers.values()):
            tiers = _assign(units, True, host, pinned, reserve=ring_reserve(largest, disk=False))
    names = {Tier.PINNED: "pinned", Tier.STAGED: "pageable", Tier.PAGEABLE: "pageable", Tier.DISK: "disk"}
    bytes_of = {p.name: dict.fromkeys(TIER_NAMES, 0) for p in parts}
    disk: dict[str, list[int]] = {p.name: [] for p in parts}
    for name, block, unit in owned:
        tier = names[tiers[id(unit.unit)]]
        bytes_of[name][tier] += unit.nbytes
        if tier == "disk" and block is not None:
            disk[name].append(block)
    on_disk = [p.name for p in parts if bytes_of[p.name]["disk"]]
    note = DISK_NOTE.format(components=", ".join(on_disk)) if on_disk else None
    return [dataclasses.replace(p, host=bytes_of[p.name], disk_blocks=tuple(sorted(disk[p.name]))) for p in parts], note
