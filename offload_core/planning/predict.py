"""What a plan predicts per phase of a call: the bytes copied and read, and the time they take.

Each phase (:mod:`.phases`) is priced from the plan's components: per forward of a running
streamed component, its streamed blocks are copied host-to-device, those whose home is on disk read
from the drive first; when a parked component's phase begins, its resident weights and kept blocks
are loaded once (the switch), and a staged or swapped component is copied whole once. A block read
from disk goes through the bounce ring, so its copy takes as long as the slower of the drive and
the link. A forward's time comes from the event model of :mod:`.timing` when its blocks' compute
time is known; without it, from its copies alone (what a copy-bound forward takes). Plain numbers.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from .components import Component
from .phases import Phase
from .plan import RESIDENT, STAGED, STREAMED, SWAPPED, ComponentPlan, PhasePlan
from .timing import simulate

#: what a drive reads per second when the plan is not told (--disk-bandwidth): about what a PCIe 4.0
#: NVMe drive sustains for large sequential reads
DEFAULT_DISK_BANDWIDTH = 3e9


@dataclasses.dataclass(frozen=True)
class Rates:
    """Bytes per second of the host-to-device link (``h2d``, None: unknown) and of the drive
    (``disk``), with where the drive's figure comes from."""

    h2d: float | None
    disk: float = DEFAULT_DISK_BANDWIDTH
    disk_source: str = "default: a PCIe 4.0 NVMe drive"

    @classmethod
    def of(cls, components: Sequence[Component], disk: float | None = None, disk_source: str | None = None) -> "Rates":
        """The link rate the components were measured with (the fastest given), and ``disk``."""
        bandwidths = [c.copy_bandwidth for c in components if c.copy_bandwidth]
        if disk is None:
            return cls(max(bandwidths) if bandwidths else None)
        return cls(max(bandwidths) if bandwidths else None, disk, disk_source or "given")

    def compute_unknown(self, components: Sequence[Component]) -> bool:
        return any(c.block_compute_s is None for c in components if c.block_bytes)

    def copy_seconds(self, nbytes: int, disk_bytes: int = 0) -> float | None:
        """Seconds to copy ``nbytes`` to the device, ``disk_bytes`` of them read from the drive on
        the way; None when the link's rate is unknown."""
        if self.h2d is None:
            return None
        return (nbytes - disk_bytes) / self.h2d + disk_bytes / min(self.h2d, self.disk)


def forward_seconds(part: ComponentPlan, component: Component, depth: int, rates: Rates) -> float | None:
    """Predicted seconds of one forward of a streamed component under ``part``."""
    if part.mode != STREAMED:
        return None
    disk = set(part.disk_blocks)
    copies = [rates.copy_seconds(b, b if i in disk else 0) for i, b in enumerate(component.block_bytes)]
    if any(c is None for c in copies):
        return None
    kept = set(part.resident_blocks)
    if component.block_compute_s is None:
        return sum(copies[i] for i in part.streamed_blocks)
    return simulate([i in kept for i in range(len(copies))], copies, component.block_compute_s, depth).seconds


def phase_plans(parts: Sequence[ComponentPlan], components: Sequence[Component], phases: Sequence[Phase],
                depth: int, rates: Rates, steps: int, peaks: Sequence[int]) -> tuple[PhasePlan, ...]:
    """The figures of each of ``phases`` under ``parts`` (host tiers filled in), whose device peaks
    the planner computed (``peaks``)."""
    by_name = {c.name: c for c in components}
    plans = {p.name: p for p in parts}
    out = []
    for phase, peak in zip(phases, peaks):
        running = [plans[n] for n in phase.components]
        holding = [p for p in parts if p.name in phase.components or not p.parks]
        resident = sum(_weights(p, by_name[p.name]) for p in holding if p.mode in (RESIDENT, STREAMED))
        streamed = [p for p in running if p.mode == STREAMED]
        h2d = sum(p.bytes_per_forward for p in streamed)
        disk = sum(by_name[p.name].block_bytes[i] for p in streamed for i in p.streamed_blocks if i in set(p.disk_blocks))
        switch = sum(_weights(p, by_name[p.name]) for p in running if p.parks) + \
            sum(p.weight_bytes for p in running if p.mode in (STAGED, SWAPPED))
        switch_disk = sum(_held_on_disk(p, by_name[p.name]) for p in running if p.parks)
        # the last forward of a phase inside a pipeline call loads the first blocks of a next
        # forward that does not come in this call (handle.frozen(): see strategies/layerwise.py)
        first = [(p, i) for p in streamed for i in p.streamed_blocks[:_slots(p, depth)]]
        preload = sum(by_name[p.name].block_bytes[i] for p, i in first)
        preload_disk = sum(by_name[p.name].block_bytes[i] for p, i in first if i in set(p.disk_blocks))
        per_forward = [forward_seconds(p, by_name[p.name], depth, rates) for p in streamed]
        forwards = phase.forwards(steps)
        switch_s = rates.copy_seconds(switch + preload, switch_disk + preload_disk)
        seconds = None
        if switch_s is not None and all(s is not None for s in per_forward):
            seconds = switch_s + forwards * sum(per_forward)
        out.append(PhasePlan(
            name=phase.name, components=phase.components, forwards_per_step=phase.forwards_per_step,
            forwards_per_call=phase.forwards_per_call if not phase.denoising else 0, share=phase.share,
            device_peak=peak, resident_bytes=resident, h2d_bytes_per_forward=h2d, disk_bytes_per_forward=disk,
            switch_h2d_bytes=switch, switch_disk_bytes=switch_disk, preload_h2d_bytes=preload,
            preload_disk_bytes=preload_disk,
            seconds_per_forward=sum(per_forward) if per_forward and all(s is not None for s in per_forward) else
            (0.0 if not per_forward and rates.h2d is not None else None),
            seconds_per_call=seconds if seconds is not None else 0.0, forwards_per_call_total=forwards,
            held=tuple(p.name for p in holding if p.name not in phase.components and p.mode == STREAMED)))
    return tuple(out)


def _held_on_disk(part: ComponentPlan, component: Component) -> int:
    """Bytes of a component's resident weights and kept blocks whose home is on disk: its disk
    bytes less those of its streamed blocks there."""
    disk = set(part.disk_blocks)
    return part.host.get("disk", 0) - sum(component.block_bytes[i] for i in part.streamed_blocks if i in disk)


def _slots(part: ComponentPlan, depth: int) -> int:
    """The slots of a streamed component's ring (one per streamed block at most)."""
    return min(depth, len(part.streamed_blocks) - 1) + 1


def _weights(part: ComponentPlan, component: Component) -> int:
    """Device bytes of a component's weights while it holds them (its resident weights and kept
    blocks, or all of it)."""
    if part.mode == RESIDENT:
        return component.total_bytes
    return component.resident_bytes + sum(component.block_bytes[i] for i in part.resident_blocks)
