"""Fitting a pipeline into a device budget: which strategy, and how many blocks stay resident.

Selection, with no strategy given (the coarsest that fits, since coarser moves fewer bytes):

1. **resident**: every component's weights plus the largest activation headroom fit;
2. **model-level**: the largest swap group (the groups of model-level offload: encoders together,
   each DiT alone, VAEs together; an input) plus its activations fits;
3. **layerwise** (distributed when ``world_size > 1``) with partial residency: see
   :func:`_layerwise`.

A strategy given explicitly is kept (the flags' priority rule is the caller's); the budget then
only sizes it, and a budget it cannot meet is an error. An impossible budget is an
:class:`~offload_core.errors.OffloadConfigError` naming the smallest budget that works.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from ..config import FLAGGED, STRATEGIES
from ..errors import OffloadConfigError
from .components import Component, device_bytes
from .hosttiers import host_tiers
from .plan import RESIDENT, STAGED, STREAMED, SWAPPED, ComponentPlan, Plan, size
from .timing import choose_resident, simulate

#: the strategies a plan can be asked to size, coarsest first
SIZED = tuple(s.name for s in reversed(FLAGGED))
#: order in which layerwise gives spare budget to resident blocks: the DiTs run every step, the
#: text encoders once per call
BLOCK_PRIORITY = ("dit", "text_encoder")
#: distributed layerwise offload always runs two slots (prefetch_depth applies to layerwise only)
DISTRIBUTED_DEPTH = 1
#: device bytes of distributed offload's load headers (strategies/gather.py, which sizes its own
#: buffers with these), per streamed block (plus one): the header a rank sends, one int64 row of
#: four per status it can send (ok, aborted, disabling, preloaded), and the headers it gathers,
#: two rows of four per rank
GATHER_SENT_BYTES = 4 * 4 * 8
GATHER_GATHERED_BYTES = 2 * 4 * 8


@dataclasses.dataclass
class _State:
    """One component during the layerwise search: resident, staged, or streamed with some blocks
    kept; ``world`` > 1: streamed by distributed layerwise offload over that many ranks."""

    component: Component
    mode: str
    kept: tuple[int, ...] = ()
    world: int = 1

    def streamed(self) -> list[int]:
        kept = set(self.kept)
        return [i for i in range(len(self.component.block_bytes)) if i not in kept]

    def slot_bytes(self, depth: int) -> int:
        """The slot ring; distributed, also a staging buffer of one shard per slot, which the
        all-gather fills, and the load headers the ranks exchange (strategies/gather.py)."""
        streamed = self.streamed()
        if not streamed:
            return 0
        slot = max(self.component.block_bytes[i] for i in streamed)
        ring = (depth + 1) * slot
        if self.world > 1:
            ring += (depth + 1) * -(-slot // self.world) + (len(streamed) + 1) * (
                GATHER_SENT_BYTES + GATHER_GATHERED_BYTES * self.world)
        return ring

    def held(self, depth: int) -> int:
        c = self.component
        if self.mode == RESIDENT:
            return c.total_bytes
        if self.mode == STAGED:
            return 0
        return c.resident_bytes + sum(c.block_bytes[i] for i in self.kept) + self.slot_bytes(depth)


def _layerwise_peak(states: Sequence[_State], depth: int) -> int:
    """Weights held all run, plus the most any one running component adds (its activations, and
    its weights when it is staged): components run one at a time."""
    running = max(s.component.activation + (s.component.total_bytes if s.mode == STAGED else 0) for s in states)
    return sum(s.held(depth) for s in states) + running


def _resident_peak(components: Sequence[Component]) -> int:
    return sum(c.total_bytes for c in components) + max(c.activation for c in components)


def _model_peak(components: Sequence[Component], groups: Sequence[Sequence[str]]) -> int:
    by_name = {c.name: c for c in components}
    return max(sum(by_name[n].total_bytes for n in g) + max(by_name[n].activation for n in g) for g in groups)


def _timings(c: Component) -> tuple[list[float] | None, float | tuple[float, ...] | None]:
    copy = [b / c.copy_bandwidth for b in c.block_bytes] if c.copy_bandwidth else None
    return copy, c.block_compute_s


def _keep(state: _State, count: int, depth: int) -> None:
    """Make ``count`` of the component's blocks resident, chosen by :func:`choose_resident`."""
    c = state.component
    copy, compute = _timings(c)
    state.kept = choose_resident(len(c.block_bytes), count, copy, compute, depth)
    state.mode = RESIDENT if count == len(c.block_bytes) else STREAMED


def _layerwise(components: Sequence[Component], budget: int, depth: int, resident_blocks: int | str,
               world: int = 1) -> tuple[list[_State], int]:
    """Layerwise with partial residency, and the smallest budget it needs (every block streamed).

    Streamable components (DiTs and text encoders with blocks) start with every block streamed,
    the others staged. The spare budget then goes, one block at a time, to resident blocks of the
    DiTs (round-robin, so two expert DiTs keep about as many each), then of the text encoders, then
    to keeping staged components resident. A component whose blocks all fit drops its slot ring (so
    when one more block does not fit beside the ring, all of them may fit without it).
    ``resident_blocks`` (an int) fixes every streamable component's resident count instead."""
    states = [_State(c, STREAMED if c.streamable else STAGED, world=world) for c in components]
    floor = _layerwise_peak(states, depth)
    if floor > budget:
        return states, floor
    streamers = [s for s in states if s.mode == STREAMED]
    if resident_blocks != "auto":
        for s in streamers:
            _keep(s, min(int(resident_blocks), len(s.component.block_bytes)), depth)
        if _layerwise_peak(states, depth) > budget:
            raise OffloadConfigError(
                f"resident_blocks={resident_blocks} needs {size(_layerwise_peak(states, depth), up=True)} of device "
                "memory, "
                f"over the budget of {size(budget)}: lower it, or use resident_blocks='auto'")
    else:
        changed = True
        while changed:  # a component made resident frees its ring: an earlier one may then grow again
            changed = False
            for kind in BLOCK_PRIORITY:
                growing = [s for s in streamers if s.component.kind == kind and s.mode == STREAMED]
                while growing:
                    for s in list(growing):
                        before = (s.mode, s.kept)
                        _keep(s, len(s.kept) + 1, depth)
                        if _layerwise_peak(states, depth) > budget:
                            _keep(s, len(s.component.block_bytes), depth)  # all of them: its ring is no longer needed
                            if _layerwise_peak(states, depth) > budget:
                                s.mode, s.kept = before
                            growing.remove(s)
                        elif s.mode == RESIDENT:
                            growing.remove(s)
                        changed |= (s.mode, s.kept) != before
    for s in states:
        if s.mode == STAGED:
            s.mode = RESIDENT
            if _layerwise_peak(states, depth) > budget:
                s.mode = STAGED
    return states, floor


def _component_plan(c: Component, mode: str, depth: int, kept: tuple[int, ...] = (), held: int = 0,
                    slot_bytes: int = 0) -> ComponentPlan:
    n = len(c.block_bytes)
    streamed = tuple(i for i in range(n) if i not in set(kept)) if mode == STREAMED else ()
    if mode == RESIDENT:
        kept = tuple(range(n))
    plan = dict(name=c.name, kind=c.kind, mode=mode, weight_bytes=c.total_bytes, device_bytes=held,
                activation_bytes=c.activation, activation_source=c.activation_source, resident_blocks=kept,
                streamed_blocks=streamed, slot_bytes=slot_bytes,
                bytes_per_call=c.total_bytes if mode in (STAGED, SWAPPED) else 0)
    if mode == STREAMED:
        copy, compute = _timings(c)
        plan.update(copies_per_forward=len(streamed), bytes_per_forward=sum(c.block_bytes[i] for i in streamed))
        if copy is not None:
            plan["copy_s_per_forward"] = sum(copy[i] for i in streamed)
        if compute is not None:
            forward = simulate([i not in streamed for i in range(n)], copy or 0.0, compute, depth)
            plan["compute_s_per_forward"] = forward.compute_seconds
            if copy is not None:
                plan["ratio"] = forward.ratio
    return ComponentPlan(**plan)


def _check_options(components: Sequence[Component], strategy: str | None, resident_blocks: object,
                   prefetch_depth: object) -> None:
    if not components:
        raise OffloadConfigError("nothing to plan: no component holds weights")
    if strategy is not None and strategy not in SIZED:
        raise OffloadConfigError(f"unknown strategy {strategy!r}; choose from {', '.join(SIZED)}")
    if resident_blocks != "auto" and (isinstance(resident_blocks, bool) or not isinstance(resident_blocks, int)
                                      or resident_blocks < 0):
        raise OffloadConfigError(f"invalid resident_blocks={resident_blocks!r}: expected 'auto' or an integer >= 0")
    if strategy == "model" and resident_blocks != "auto":
        raise OffloadConfigError("resident_blocks= applies to layerwise and distributed offload, not to model-level")
    if isinstance(prefetch_depth, bool) or not isinstance(prefetch_depth, int) or prefetch_depth < 1:
        raise OffloadConfigError(f"invalid prefetch_depth={prefetch_depth!r}: expected an integer >= 1")


def make_plan(
    components: Sequence[Component],
    device_memory: object,
    *,
    device_total: int | None = None,
    device_free: int | None = None,
    groups: Sequence[Sequence[str]] | None = None,
    strategy: str | None = None,
    resident_blocks: int | str = "auto",
    prefetch_depth: int = 1,
    world_size: int = 1,
    host_memory: object = None,
    pinned_memory: object = None,
    bandwidth_source: str = "given",
) -> Plan:
    """The plan of ``components`` under ``device_memory`` (bytes, "16GiB", or a fraction of
    ``device_total``). ``device_free``: the device's usable memory now (``backend.mem_get_info()[0]``),
    when the plan is for this device: a budget above it is clamped to it, with a note naming both
    (:func:`clamp_note`). ``groups``: the model-level swap groups, as lists of component names (default:
    each component alone). ``strategy``: None (chosen by the budget) or one of "model", "layerwise",
    "distributed" (sized by the budget). ``resident_blocks``: "auto" or an int, the resident block
    count of every streamed component. ``world_size`` > 1: the layerwise stage is distributed, which
    always runs two slots (``prefetch_depth`` sizes layerwise rings only).
    ``host_memory`` / ``pinned_memory``: the host budgets, which split the host bytes into pinned,
    pageable and disk (without either, everything is reported pinned). Components' copy bandwidth
    and block compute times feed the predictions (``bandwidth_source`` says where the bandwidth
    came from, for the text)."""
    _check_options(components, strategy, resident_blocks, prefetch_depth)
    asked = device_bytes(device_memory, device_total)
    budget = asked if device_free is None else min(asked, device_free)
    groups = [list(g) for g in groups] if groups is not None else [[c.name] for c in components]
    layered = "distributed" if world_size > 1 else "layerwise"
    notes: list[str] = [clamp_note(asked, device_free, device_total)] if budget < asked else []
    if (strategy or layered) == "distributed":
        prefetch_depth = DISTRIBUTED_DEPTH

    resident_need, model_need = _resident_peak(components), _model_peak(components, groups)
    chosen = strategy
    if chosen is None:
        if resident_need <= budget:
            chosen = "resident"
        elif model_need <= budget:
            chosen = "model"
        else:
            chosen = layered
        if chosen in ("resident", "model") and resident_blocks != "auto":
            notes.append(f"resident_blocks={resident_blocks} unused: the budget allows {chosen} placement")
    if chosen == "model":
        if model_need > budget:
            raise OffloadConfigError(f"device_memory={size(budget)} is below the {size(model_need, up=True)} "
                                     "model-level offload needs (its largest group and that group's activations)")
        parts = [_component_plan(c, SWAPPED, prefetch_depth) for c in components]
        peak, min_budget = model_need, model_need
    elif chosen == "resident":
        parts = [_component_plan(c, RESIDENT, prefetch_depth, held=c.total_bytes) for c in components]
        peak = resident_need
        min_budget = min(resident_need, model_need, _layerwise(components, 0, prefetch_depth, "auto", world_size)[1])
    else:
        states, floor = _layerwise(components, budget, prefetch_depth, resident_blocks,
                                   world_size if chosen == "distributed" else 1)
        smallest = floor if strategy is not None else min(floor, model_need)
        if floor > budget:
            raise OffloadConfigError(
                f"device_memory={size(budget)} is too small: the smallest budget that works is "
                f"{size(smallest, up=True)} "
                f"({STRATEGIES[layered if smallest == floor else 'model'].words}"
                + (", every block streamed" if smallest == floor else "") + ")")
        parts = [_component_plan(s.component, s.mode, prefetch_depth, s.kept, s.held(prefetch_depth),
                                 s.slot_bytes(prefetch_depth) if s.mode == STREAMED else 0) for s in states]
        peak, min_budget = _layerwise_peak(states, prefetch_depth), smallest
    return _finish(components, parts, notes, strategy=chosen, chosen_by="flag" if strategy is not None else "budget",
                   budget=budget, asked_budget=asked, device_total=device_total, device_peak=peak,
                   min_budget=min_budget, prefetch_depth=prefetch_depth, world_size=world_size,
                   host_memory=host_memory, pinned_memory=pinned_memory, bandwidth_source=bandwidth_source)


def describe(
    components: Sequence[Component],
    layout: Mapping[str, tuple[str, tuple[int, ...]]],
    strategy: str,
    *,
    device_total: int | None = None,
    groups: Sequence[Sequence[str]] | None = None,
    prefetch_depth: int = 1,
    world_size: int = 1,
    host_memory: object = None,
    pinned_memory: object = None,
) -> Plan:
    """The plan of what a strategy flag does without a device budget: ``layout`` gives each
    component's mode (resident, streamed, staged, swapped) and resident blocks as the strategy
    set them up; the figures (device bytes held and at the peak, host tiers, bytes copied per
    forward) are the planner's, by the same rules as :func:`make_plan`'s."""
    if strategy == "distributed":
        prefetch_depth = DISTRIBUTED_DEPTH
    notes: list[str] = []
    if strategy == "model":
        groups = [list(g) for g in groups] if groups is not None else [[c.name] for c in components]
        parts = [_component_plan(c, SWAPPED, prefetch_depth) for c in components]
        peak = _model_peak(components, groups)
        if len(groups) > 1:
            notes.append("the next group is prefetched beside the running one when the device has room for both: "
                         "the peak may then reach two groups (a device_memory budget keeps it within the budget)")
    else:
        states = [_State(c, *layout[c.name], world=world_size if strategy == "distributed" else 1)
                  for c in components]
        parts = [_component_plan(s.component, s.mode, prefetch_depth, s.kept, s.held(prefetch_depth),
                                 s.slot_bytes(prefetch_depth) if s.mode == STREAMED else 0) for s in states]
        peak = _layerwise_peak(states, prefetch_depth)
    return _finish(components, parts, notes, strategy=strategy, chosen_by="flag", budget=None, asked_budget=None,
                   device_total=device_total, device_peak=peak, min_budget=None, prefetch_depth=prefetch_depth,
                   world_size=world_size, host_memory=host_memory, pinned_memory=pinned_memory,
                   bandwidth_source="given")


def _finish(components: Sequence[Component], parts: list[ComponentPlan], notes: list[str], *, strategy: str,
            world_size: int, host_memory: object, pinned_memory: object, **plan) -> Plan:
    """The :class:`Plan` of ``parts``, with its host tiers and the notes every plan shares."""
    if any(c.activation_source == "estimate" for c in components):
        notes.append("activation headroom is an estimate (each component's largest block, or all its weights "
                     "without blocks): activation_memory= (--activation-memory) gives the real figure")
    if strategy == "distributed":
        notes.append(f"distributed over {world_size} ranks: each rank's device holds the plan above; with "
                     "shard_host_weights=True (the default) each rank's host keeps 1/N of each streamed block")
    bandwidths = {c.copy_bandwidth for c in components if c.copy_bandwidth}
    if strategy != "resident":  # with no offload, the weights have no host copy
        parts, host_note = host_tiers(parts, components, host_memory, pinned_memory, world_size)
        notes.extend([host_note] if host_note else [])
    return Plan(strategy=strategy, bandwidth=max(bandwidths) if bandwidths else None, components=tuple(parts),
                notes=tuple(notes), **plan)


def clamp_note(asked: int, free: int, total: int | None) -> str:
    """What a plan says of a budget above the device's usable memory: both figures, in words and
    in bytes (a 24 GB card has less than "24GiB" free, and one decimal cannot show by how much)."""
    of = f" of {size(total)}" if total else ""
    return (f"device_memory={size(asked)} ({asked} bytes) is more than the device's usable memory, {size(free)} "
            f"({free} bytes) free{of}: the plan uses {size(free)}; give at most that to plan for it exactly")
