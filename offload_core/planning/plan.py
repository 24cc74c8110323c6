"""The plan: per component, what stays on the device, what streams, and what that is predicted to cost.

A :class:`Plan` is plain data, made by :func:`offload_core.planning.make_plan`; ``to_dict()`` is the
``offload-core plan --json`` document and ``render()`` its text.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from ..common.config import STRATEGIES
from .peaks import group_peak, phase_peak

#: what a component does under the plan
RESIDENT = "resident"  # on the device for the whole run
STREAMED = "streamed"  # layerwise: its resident blocks stay, the others stream through the slot ring
STAGED = "staged"  # copied onto the device around its use and dropped after (a VAE under layerwise)
SWAPPED = "swapped"  # model-level: its group swaps in when it runs


def size(n: float, up: bool = False) -> str:
    """Bytes in words, binary units ("23.8 GiB"). ``up``: rounded up, so that a smallest budget
    that works, typed back as printed (``device_memory="23.8 GiB"``), is still at least ``n``."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{-(-math.ceil(n) * 10 // scale) / 10:.1f} {unit}" if up else f"{n / scale:.1f} {unit}"
    return f"{math.ceil(n) if up else int(n)} B"


def seconds(s: float) -> str:
    """Seconds in words, three significant digits ("1.78 s", "24.1 ms")."""
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def index_ranges(indices: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2, 5, 7-8"``; "none" when empty."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs) or "none"


@dataclasses.dataclass(frozen=True)
class ComponentPlan:
    """One component under the plan. ``device_bytes``: the device memory its weights hold for the
    whole run (resident weights and blocks, and its slot ring); a staged or swapped component holds
    its weights only while it runs. ``parks``: a streamed component that holds nothing on the device
    while another phase of the call runs (its resident weights and kept blocks are loaded again when
    its phase comes back). ``host``: bytes per host tier (pinned, pageable, disk); ``disk_blocks``:
    the blocks whose home is on disk. Per
    forward of the component (a denoising step makes one, or two with classifier-free guidance):
    the copies (one per streamed block; the strategies make one per dtype of a block) and bytes, the
    predicted copy and compute seconds and their ``ratio`` (forward time
    over the all-resident forward time; None when a time is unknown). ``bytes_per_call``: what is
    copied once per pipeline call (a staged or swapped component)."""

    name: str
    kind: str
    mode: str
    weight_bytes: int
    device_bytes: int
    activation_bytes: int
    activation_source: str
    resident_blocks: tuple[int, ...] = ()
    streamed_blocks: tuple[int, ...] = ()
    slot_bytes: int = 0
    host: dict[str, int] = dataclasses.field(default_factory=dict)
    parks: bool = False
    disk_blocks: tuple[int, ...] = ()
    copies_per_forward: int = 0
    bytes_per_forward: int = 0
    bytes_per_call: int = 0
    copy_s_per_forward: float | None = None
    compute_s_per_forward: float | None = None
    ratio: float | None = None

    @property
    def n_blocks(self) -> int:
        return len(self.resident_blocks) + len(self.streamed_blocks)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(resident_blocks=list(self.resident_blocks), streamed_blocks=list(self.streamed_blocks),
                    disk_blocks=list(self.disk_blocks))
        return data

    def render(self, bandwidth: float | None) -> list[str]:
        n = self.n_blocks
        head = {RESIDENT: "resident", STAGED: "staged onto the device around its use",
                SWAPPED: "swapped in with its group"}.get(self.mode, f"{len(self.resident_blocks)} of {n} blocks resident")
        if self.mode == RESIDENT and n:
            head += f" (all {n} blocks)"
        lines = [f"{self.name} ({self.kind}): {head}"]
        if self.mode == STREAMED:
            lines.append(f"  resident blocks  {index_ranges(self.resident_blocks)}")
            lines.append(f"  streamed blocks  {index_ranges(self.streamed_blocks)}")
        device = f"{size(self.device_bytes)} held " + ("while its phase runs" if self.parks else "for the whole run")
        if self.slot_bytes:
            device += f" (slot ring {size(self.slot_bytes)})"
        if self.mode in (STAGED, SWAPPED):
            device = f"{size(self.weight_bytes)} while it runs"
        lines.append(f"  device           {device}; activations {size(self.activation_bytes)} "
                     f"({self.activation_source})")
        host = ", ".join(f"{size(v)} {tier}" for tier, v in self.host.items() if v)
        lines.append("  host             " + (host or "no copy (no offload: the weights live on the device)"))
        if self.mode == STREAMED:
            per = f"  per forward      {self.copies_per_forward} copies, {size(self.bytes_per_forward)}"
            if self.copy_s_per_forward is not None:
                per += f", {seconds(self.copy_s_per_forward)} of copying at {bandwidth / 1e9:.1f} GB/s"
            if self.compute_s_per_forward is not None and self.ratio is not None:
                per += f" against {seconds(self.compute_s_per_forward)} of compute: predicted {self.ratio:.2f}x " \
                       "the resident forward"
            else:
                per += " (block compute time unknown: no predicted ratio)"
            lines.append(per)
        elif self.bytes_per_call:
            lines.append(f"  per call         {size(self.bytes_per_call)} copied once")
        return lines


def _phase_words(phase: Any) -> str:
    runs = (f"{phase.forwards_per_step} forward(s) per step" + (f", {phase.share:.0%} of the steps"
                                                                 if phase.share < 1 else "")
            if phase.forwards_per_step else f"{phase.forwards_per_call} forward(s) per call")
    return f"{phase.name}: {', '.join(phase.components)} ({runs})"


@dataclasses.dataclass(frozen=True)
class PhasePlan:
    """One phase of a call under the plan (see :mod:`.phases`). ``device_peak``: the device at its
    fullest while it runs; ``resident_bytes``: the weights on the device through it (its running
    components' resident weights and kept blocks, and those of the components that do not park);
    ``held``: the streamed components not running in it that keep their weights on the device.
    Per forward of its running components: ``h2d_bytes_per_forward`` copied, of which
    ``disk_bytes_per_forward`` read from disk first. When it begins: ``switch_h2d_bytes`` loaded
    (parked components' resident weights and kept blocks, staged or swapped components whole), of
    which ``switch_disk_bytes`` from disk. ``preload_h2d_bytes``: what its last forward in a pipeline
    call copies for a next forward that does not come in that call (the first blocks, loaded early
    inside ``handle.frozen()``), of which ``preload_disk_bytes`` read from disk. ``seconds_per_forward``: the predicted time of one forward
    of its streamed components (None: unknown); ``seconds_per_call``: of the whole phase in one call
    (``forwards_per_call_total`` forwards and the switch)."""

    name: str
    components: tuple[str, ...]
    forwards_per_step: int
    forwards_per_call: int
    share: float
    device_peak: int
    resident_bytes: int
    h2d_bytes_per_forward: int
    disk_bytes_per_forward: int
    switch_h2d_bytes: int
    switch_disk_bytes: int
    preload_h2d_bytes: int
    preload_disk_bytes: int
    seconds_per_forward: float | None
    seconds_per_call: float
    forwards_per_call_total: float
    held: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.update(components=list(self.components), held=list(self.held))
        return data

    def render(self) -> list[str]:
        if self.forwards_per_step:
            share = f", {self.share:.0%} of the steps" if self.share < 1 else ""
            runs = f"{self.forwards_per_step} forward{'s' if self.forwards_per_step > 1 else ''} per step{share}"
        else:
            runs = f"{self.forwards_per_call} forward{'s' if self.forwards_per_call > 1 else ''} per call"
        lines = [f"{self.name}: {', '.join(self.components)} ({runs})"]
        held = f"; {', '.join(self.held)} kept on the device" if self.held else ""
        lines.append(f"  device peak {size(self.device_peak)}, weights on the device {size(self.resident_bytes)}{held}")
        if self.h2d_bytes_per_forward:
            disk = f", {size(self.disk_bytes_per_forward)} of them read from disk" if self.disk_bytes_per_forward else \
                ", nothing read from disk"
            lines.append(f"  per forward {size(self.h2d_bytes_per_forward)} copied{disk}")
        if self.switch_h2d_bytes:
            disk = f" ({size(self.switch_disk_bytes)} from disk)" if self.switch_disk_bytes else ""
            lines.append(f"  when it begins {size(self.switch_h2d_bytes)} loaded{disk}")
        if self.seconds_per_forward is not None and self.h2d_bytes_per_forward:
            lines.append(f"  predicted {seconds(self.seconds_per_forward)} per forward, "
                         f"{seconds(self.seconds_per_call)} per call")
        elif self.seconds_per_call:
            lines.append(f"  predicted {seconds(self.seconds_per_call)} per call")
        return lines


@dataclasses.dataclass(frozen=True)
class Plan:
    """The plan of one pipeline (or model) under one device budget, or, without one, what a
    strategy flag alone does with it.

    ``strategy``: "resident", "model", "layerwise" or "distributed"; ``chosen_by``: "budget" (no
    strategy was given) or "flag". ``budget``: the device budget planned for (None without one);
    ``asked_budget``: the one given, more than ``budget`` when it was above the device's usable
    memory and clamped to it (a note says so). ``device_peak``: the predicted device memory at its
    highest (weights held, plus the largest running component's activations, and its weights when
    staged). ``min_budget``: the smallest budget under which this strategy (or, chosen by budget,
    any) works; None without a budget. ``phases``: the figures of each phase of a call of ``steps``
    denoising steps (empty for a plan made without phases), from ``phases_source``;
    ``disk_bandwidth``: the drive's read rate their times assume. ``host_budget``: the RAM the host
    tiers were planned for (None: none given, every host byte counted as pinned), from
    ``host_budget_source``.
    """

    strategy: str
    chosen_by: str
    budget: int | None
    device_total: int | None
    device_peak: int
    min_budget: int | None
    prefetch_depth: int
    bandwidth: float | None
    bandwidth_source: str
    components: tuple[ComponentPlan, ...]
    notes: tuple[str, ...] = ()
    asked_budget: int | None = None
    phases: tuple[PhasePlan, ...] = ()
    phases_source: str | None = None
    steps: int | None = None
    disk_bandwidth: float | None = None
    disk_bandwidth_source: str | None = None
    host_budget: int | None = None
    host_budget_source: str | None = None
    groups: tuple[tuple[str, ...], ...] = ()
    observed_phases: tuple = ()

    def measured(self, activations: dict[str, int]) -> "Plan":
        """This plan with the activation bytes its components' first calls measured, and the
        device peaks they make (per phase, and at most). A component that needed more than the plan
        reserved gets a note (the budget may be exceeded: give ``activation_memory=``)."""
        if not activations:
            return self
        components, notes = [], list(self.notes)
        for c in self.components:
            used = activations.get(c.name)
            if used is None:
                components.append(c)
                continue
            if used > c.activation_bytes:
                notes.append(f"{c.name} took {size(used)} beyond its weights on its first call, over the "
                             f"{size(c.activation_bytes)} reserved: the budget may be exceeded; give activation_memory=")
            components.append(dataclasses.replace(c, activation_bytes=used, activation_source="measured"))
        plan = dataclasses.replace(self, components=tuple(components), notes=tuple(notes))
        peaks = [plan._peak(p) for p in plan.phases] if plan.phases else [plan._peak(None)]
        phases = tuple(dataclasses.replace(p, device_peak=peak) for p, peak in zip(plan.phases, peaks))
        return dataclasses.replace(plan, phases=phases, device_peak=max(peaks))

    def observed(self, order: list[str], steps: int) -> "Plan":
        """This plan with the phases of a call in which its components began their forwards in
        ``order`` over ``steps`` steps (``planning.phases.observed``), and a note where they are
        not the phases it was made for."""
        from .phases import OBSERVED, observed

        seen = observed(order, {c.name: c.kind for c in self.components}, steps)
        planned = [(p.name, tuple(p.components), p.forwards_per_step) for p in self.phases]
        notes = list(self.notes)
        if planned and self.phases_source != OBSERVED and planned != [(p.name, p.components, p.forwards_per_step)
                                                                      for p in seen]:
            notes.append("the first call's phases differ from the " + (self.phases_source or "planned") + " ones: "
                         + "; ".join(_phase_words(p) for p in seen))
        return dataclasses.replace(self, observed_phases=seen, notes=tuple(notes))

    def _peak(self, phase: "PhasePlan | None") -> int:
        """The device at its fullest in ``phase`` (None: a plan without phases, where every
        component holds its weights all along and runs in turn), by the planner's own rules."""
        running = phase.components if phase is not None else [c.name for c in self.components]
        if self.strategy == "model":
            groups = self.groups or tuple((c.name,) for c in self.components)
            return group_peak({c.name: (c.weight_bytes, c.activation_bytes) for c in self.components}, groups,
                              running, self.budget)
        return phase_peak(((c.name, c.device_bytes,
                            c.activation_bytes + (c.weight_bytes if c.mode in (STAGED, SWAPPED) else 0), c.parks)
                           for c in self.components), running)

    def component(self, name: str) -> ComponentPlan:
        for c in self.components:
            if c.name == name:
                return c
        raise KeyError(f"no component {name!r} in the plan; components: {', '.join(c.name for c in self.components)}")

    @property
    def bytes_per_forward(self) -> dict[str, int]:
        """Host-to-device bytes each streamed component copies per forward (what ``handle.stats()``
        counts as ``h2d_bytes`` for one forward of it)."""
        return {c.name: c.bytes_per_forward for c in self.components if c.mode == STREAMED}

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data.update(components=[c.to_dict() for c in self.components], notes=list(self.notes),
                    phases=[p.to_dict() for p in self.phases],
                    observed_phases=[dict(dataclasses.asdict(p), components=list(p.components))
                                     for p in self.observed_phases])
        return data

    @property
    def seconds_per_call(self) -> float | None:
        """The predicted time of one call: its phases' (None without phases)."""
        return sum(p.seconds_per_call for p in self.phases) if self.phases else None

    def __str__(self) -> str:
        return self.render()

    def render(self) -> str:
        by = "the budget" if self.chosen_by == "budget" else "the strategy flag"
        if self.budget is None:
            lines = [f"no device budget: {STRATEGIES[self.strategy].phrase}, chosen by {by}",
                     f"predicted device peak {size(self.device_peak)}"]
        else:
            total = f" of {size(self.device_total)}" if self.device_total else ""
            clamped = f" (clamped from {size(self.asked_budget)})" if (self.asked_budget or 0) > self.budget else ""
            lines = [f"budget {size(self.budget)}{total}{clamped}: {STRATEGIES[self.strategy].phrase}, chosen by {by}",
                     f"predicted device peak {size(self.device_peak)}; the smallest budget that works: "
                     f"{size(self.min_budget, up=True)}"]
        if self.strategy in ("layerwise", "distributed"):
            bandwidth = f"{self.bandwidth / 1e9:.1f} GB/s ({self.bandwidth_source})" if self.bandwidth else "unknown"
            lines.append(f"prefetch depth {self.prefetch_depth} ({self.prefetch_depth + 1} slots per streamed "
                         f"component); host-to-device bandwidth {bandwidth}")
        lines.append("")
        for c in self.components:
            lines.extend(c.render(self.bandwidth))
        if self.phases:
            disk = f", the drive at {self.disk_bandwidth / 1e9:.1f} GB/s ({self.disk_bandwidth_source})" \
                if self.disk_bandwidth else ""
            host = f"; RAM for weights {size(self.host_budget)} ({self.host_budget_source})" \
                if self.host_budget is not None else ""
            lines.extend(["", f"phases of a call of {self.steps} steps ({self.phases_source}){disk}{host}:"])
            for p in self.phases:
                lines.extend(p.render())
            if self.seconds_per_call:
                lines.append(f"predicted {seconds(self.seconds_per_call)} per call")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)
