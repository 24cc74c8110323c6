"""Fitting a pipeline into a device budget: which strategy, and how many blocks stay resident.

Selection, with no strategy given (the coarsest that fits, since coarser moves fewer bytes):

1. **resident**: every component's weights plus the largest activation headroom fit;
2. **model-level**: the largest swap group (the groups of model-level offload: encoders together,
   each DiT alone, VAEs together; an input) plus its activations fits;
3. **layerwise** (distributed when ``world_size > 1``) with partial residency: see
   :func:`_layerwise`.

A strategy given explicitly is kept (the flags' priority rule is the caller's); the budget then
only sizes it, and a budget it cannot meet is an error. An impossible budget is an
:class:`~offload_core.base.errors.OffloadConfigError` naming the smallest budget that works.

Given the phases of a call (:mod:`.phases`), layerwise plans the run, not the pipeline: each phase
gets the device. A streamed component that *parks* holds nothing on the device while another phase
runs (its resident weights, kept blocks and slot ring are released at the switch and loaded again
when its phase comes back), so its kept blocks are sized by its own phase alone; one that does not
park keeps them through every phase. Which components park, and how many blocks each keeps, is
the choice with the least predicted time of one call (:mod:`.predict`). Without phases (a plan
from byte counts alone), every component holds its weights for the whole run and components run
one at a time, as before phases existed.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Mapping, Sequence

from ..common.config import FLAGGED, STRATEGIES
from ..base.errors import OffloadConfigError
from .components import Component, device_bytes
from .hosttiers import host_tiers
from .phases import Phase
from .plan import RESIDENT, STAGED, STREAMED, SWAPPED, ComponentPlan, Plan, size
from .peaks import group_peak, phase_peak
from .predict import Rates, phase_plans
from .timing import choose_resident, simulate

#: the strategies a plan can be asked to size, coarsest first
SIZED = tuple(s.name for s in reversed(FLAGGED))
#: order in which layerwise gives spare budget to resident blocks when their gains tie: the DiTs run
#: every step, the text encoders once per call
BLOCK_PRIORITY = ("dit", "text_encoder")
#: distributed layerwise offload always runs two slots (prefetch_depth applies to layerwise only)
DISTRIBUTED_DEPTH = 1
#: device bytes of distributed offload's load headers (strategies/gather.py, which sizes its own
#: buffers with these), per streamed block (plus one): the header a rank sends, one int64 row of
#: four per status it can send (ok, aborted, disabling, preloaded), and the headers it gathers,
#: two rows of four per rank
GATHER_SENT_BYTES = 4 * 4 * 8
GATHER_GATHERED_BYTES = 2 * 4 * 8
#: the phase of a plan made without phases: every component holds its weights all along
ONE_PHASE = "run"
#: bytes per second the choice between layouts assumes when the link's rate is unknown (a PCIe 4.0 x16
#: link's): it only weighs copies against reads from disk
NOMINAL_H2D = 25e9


@dataclasses.dataclass
class _State:
    """One component during the layerwise search: resident, staged, or streamed with some blocks
    kept; ``world`` > 1: streamed by distributed layerwise offload over that many ranks; ``parks``:
    it holds nothing on the device while a phase it does not run in runs."""

    component: Component
    mode: str
    kept: tuple[int, ...] = ()
    world: int = 1
    parks: bool = False

    def streamed(self) -> list[int]:
        kept = set(self.kept)
        return [i for i in range(len(self.component.block_bytes)) if i not in kept]

    def slot_bytes(self, depth: int) -> int:
        """The slot ring; distributed, also a staging buffer of one shard per slot, which the
        all-gather fills, and the load headers the ranks exchange (strategies/gather.py)."""
        streamed = self.streamed()
        if self.mode != STREAMED or not streamed:
            return 0
        slot = max(self.component.block_bytes[i] for i in streamed)
        slots = min(depth, len(streamed) - 1) + 1  # as the strategy sizes its ring: one slot per block at most
        ring = slots * slot
        if self.world > 1:
            ring += slots * -(-slot // self.world) + (len(streamed) + 1) * (
                GATHER_SENT_BYTES + GATHER_GATHERED_BYTES * self.world)
        return ring

    def weights(self) -> int:
        """Device bytes of its weights while it holds them (its phase, or all along): resident
        weights and kept blocks, or the whole component."""
        c = self.component
        if self.mode == RESIDENT:
            return c.total_bytes
        if self.mode == STAGED:
            return 0
        return c.resident_bytes + sum(c.block_bytes[i] for i in self.kept)

    def held(self, depth: int) -> int:
        """Device bytes it holds while it holds anything: its weights and its slot ring."""
        return self.weights() + self.slot_bytes(depth)


def _phase_peak(states: Sequence[_State], phase: Phase, depth: int) -> int:
    """The device at its fullest in ``phase`` (:func:`.predict.phase_peak`)."""
    return phase_peak(((s.component.name, s.held(depth),
                        s.component.activation + (s.component.total_bytes if s.mode == STAGED else 0), s.parks)
                       for s in states), phase.components)


def _layerwise_peak(states: Sequence[_State], phases: Sequence[Phase], depth: int) -> int:
    return max(_phase_peak(states, p, depth) for p in phases)


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


def _gain(state: _State, phases: Sequence[Phase], steps: int) -> float:
    """Copies one more kept block saves per call, in block loads: one per forward of the
    component, less one per load of its kept blocks when it parks (once per phase it enters)."""
    name = state.component.name
    mine = [p for p in phases if name in p.components]
    return sum(p.forwards(steps) for p in mine) - (len(mine) if state.parks else 0)


def _grow(states: list[_State], phases: Sequence[Phase], budget: int, depth: int, steps: int,
          fixed: set[int] = frozenset()) -> None:
    """Spare budget to kept blocks, one block at a time, to the component whose block saves the
    most copies per call (DiTs before text encoders on a tie, then the one with fewer kept, so two
    alike grow in turn). A component that does not park and whose blocks all fit drops its slot
    ring (so when one more block does not fit beside the ring, all of them may fit without it); one
    that parks keeps one block streaming (all of it is loaded at each switch either way). The
    states whose ids are in ``fixed`` keep what they have."""
    full: set[int] = set(fixed)
    kind = {k: r for r, k in enumerate(BLOCK_PRIORITY)}
    while True:
        growing = [s for s in states if s.mode == STREAMED and id(s) not in full and _gain(s, phases, steps) > 0]
        if not growing:
            return
        s = min(growing, key=lambda s: (-_gain(s, phases, steps), kind.get(s.component.kind, 9), len(s.kept)))
        before = (s.mode, s.kept)
        n = len(s.component.block_bytes)
        if len(s.kept) + 1 < n or not s.parks:
            _keep(s, len(s.kept) + 1, depth)
            if _layerwise_peak(states, phases, depth) <= budget:
                continue
            if not s.parks:
                _keep(s, n, depth)  # all of them: its ring is no longer needed
                if _layerwise_peak(states, phases, depth) <= budget:
                    continue
        s.mode, s.kept = before
        full.add(id(s))


def _layerwise(components: Sequence[Component], phases: Sequence[Phase], budget: int, depth: int,
               resident_blocks: int | str, world: int, rates: Rates, steps: int,
               host_memory: object, pinned_memory: object) -> tuple[list[_State], int]:
    """Layerwise with partial residency, and the smallest budget it needs (every block streamed,
    every component that may park parked).

    Streamable components (DiTs and text encoders with blocks) start with every block streamed,
    the others staged. Each choice of which streamed components park (only with phases, and not
    across ranks) is sized: the spare budget goes to kept blocks (:func:`_grow`), then to keeping
    staged components resident; the choice with the least predicted time of a call wins (the one
    that parks most, on a tie). ``resident_blocks`` (an int) fixes every streamable component's
    resident count instead."""
    may_park = len(phases) > 1 and world == 1
    states = [_State(c, STREAMED if c.streamable else STAGED, world=world, parks=may_park and c.streamable)
              for c in components]
    floor = _layerwise_peak(states, phases, depth)
    if floor > budget:
        return states, floor
    streamers = [i for i, s in enumerate(states) if s.mode == STREAMED]
    encoders = [i for i in streamers if states[i].component.kind != "dit"]
    holdings = [()] + [h for r in range(1, len(streamers) + 1) for h in itertools.combinations(streamers, r)] \
        if may_park else [()]
    # a text encoder runs once or twice per call: whether its spare budget is worth a kept block (which,
    # when it parks, is loaded once per call anyway, and takes RAM from blocks read every step) is weighed too
    idle = [h for r in range(len(encoders) + 1) for h in itertools.combinations(encoders, r)] \
        if resident_blocks == "auto" else [()]
    best: tuple[float, list[_State]] | None = None
    refusal = None
    for holding, unkept in itertools.product(holdings, idle):
        trial = [dataclasses.replace(s, parks=s.parks and i not in holding) for i, s in enumerate(states)]
        if _layerwise_peak(trial, phases, depth) > budget:
            continue
        if resident_blocks != "auto":
            for s in trial:
                if s.mode == STREAMED:
                    count = min(int(resident_blocks), len(s.component.block_bytes) - (1 if s.parks else 0))
                    _keep(s, count, depth)
            if _layerwise_peak(trial, phases, depth) > budget:
                refusal = _layerwise_peak(trial, phases, depth)
                continue
        else:
            _grow(trial, phases, budget, depth, steps, fixed={id(trial[i]) for i in unkept})
        for s in trial:
            if s.mode == STAGED:
                s.mode = RESIDENT
                if _layerwise_peak(trial, phases, depth) > budget:
                    s.mode = STAGED
        seconds = _call_seconds(trial, phases, depth, rates, steps, host_memory, pinned_memory)
        if best is None or seconds < best[0] * (1 - 1e-9):  # a tie (relative: any unit) keeps the earlier
            best = (seconds, trial)
    if best is None:
        raise OffloadConfigError(
            f"resident_blocks={resident_blocks} needs {size(refusal, up=True)} of device memory, "
            f"over the budget of {size(budget)}: lower it, or use resident_blocks='auto'")
    return best[1], floor


def _resized(components: Sequence[Component], phases: Sequence[Phase], budget: int, depth: int, steps: int,
             before: Sequence[ComponentPlan]) -> list[_State]:
    """The layout of ``before`` (a plan that runs) with the kept blocks of its components that park
    sized again (a re-plan with measured activations): every other component keeps its mode and
    blocks, since its homes and parts were made for them."""
    planned = {p.name: p for p in before}
    states = []
    for c in components:
        p = planned[c.name]
        resizes = p.mode == STREAMED and p.parks
        states.append(_State(c, p.mode, () if resizes else p.resident_blocks, parks=p.parks))
    _grow(states, phases, budget, depth, steps,
          fixed={id(s) for s in states if not (s.mode == STREAMED and s.parks)})
    return states


def _call_seconds(states: Sequence[_State], phases: Sequence[Phase], depth: int, rates: Rates, steps: int,
                  host_memory: object, pinned_memory: object) -> float:
    """The predicted time of one call under ``states`` (what :func:`_layerwise` minimises); with
    the link's rate unknown, at a nominal one (what is compared is then bytes)."""
    if rates.h2d is None:
        rates = dataclasses.replace(rates, h2d=NOMINAL_H2D)
    parts = [_component_plan(s.component, s.mode, depth, s.kept, s.held(depth), s.slot_bytes(depth), s.parks)
             for s in states]
    parts, _ = host_tiers(parts, [s.component for s in states], host_memory, pinned_memory, states[0].world)
    phased = phase_plans(parts, [s.component for s in states], phases, depth, rates, steps,
                         [_phase_peak(states, p, depth) for p in phases])
    return sum(p.seconds_per_call for p in phased)


def _component_plan(c: Component, mode: str, depth: int, kept: tuple[int, ...] = (), held: int = 0,
                    slot_bytes: int = 0, parks: bool = False) -> ComponentPlan:
    n = len(c.block_bytes)
    streamed = tuple(i for i in range(n) if i not in set(kept)) if mode == STREAMED else ()
    if mode == RESIDENT:
        kept = tuple(range(n))
    plan = dict(name=c.name, kind=c.kind, mode=mode, weight_bytes=c.total_bytes, device_bytes=held,
                activation_bytes=c.activation, activation_source=c.activation_source, resident_blocks=kept,
                streamed_blocks=streamed, slot_bytes=slot_bytes, parks=parks and mode == STREAMED,
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


def _phases_of(components: Sequence[Component], phases: Sequence[Phase] | None) -> tuple[Phase, ...]:
    """``phases`` with every component in one (one left out runs in a phase of its own); without
    phases, one phase in which every component runs (none ever parks)."""
    if not phases:
        return (Phase(ONE_PHASE, tuple(c.name for c in components), forwards_per_step=1),)
    named = {n for p in phases for n in p.components}
    known = {c.name for c in components}
    kept = [dataclasses.replace(p, components=tuple(n for n in p.components if n in known)) for p in phases]
    kept = [p for p in kept if p.components]
    return tuple(kept) + tuple(Phase(c.name, (c.name,)) for c in components if c.name not in named)


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
    phases: Sequence[Phase] | None = None,
    phases_source: str | None = None,
    steps: int = 1,
    rates: Rates | None = None,
    relayout: Sequence[ComponentPlan] | None = None,
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
    pageable and disk (without either, everything is reported pinned). ``phases`` (:mod:`.phases`,
    from ``phases_source``): when each component runs, over calls of ``steps`` denoising steps;
    without them every component holds its weights all along. ``rates``: the copy and disk
    bandwidths the predicted times use (default: the components' own copy bandwidth, no disk figure);
    ``bandwidth_source`` says where the copy bandwidth came from, for the text. ``relayout``: the
    components of a layerwise plan that runs, whose layout stays but for the kept blocks of those
    that park, sized again (see :func:`_resized`)."""
    _check_options(components, strategy, resident_blocks, prefetch_depth)
    asked = device_bytes(device_memory, device_total)
    budget = asked if device_free is None else min(asked, device_free)
    groups = [list(g) for g in groups] if groups is not None else [[c.name] for c in components]
    layered = "distributed" if world_size > 1 else "layerwise"
    notes: list[str] = [clamp_note(asked, device_free, device_total)] if budget < asked else []
    if (strategy or layered) == "distributed":
        prefetch_depth = DISTRIBUTED_DEPTH
    phased = _phases_of(components, phases)
    rates = rates or Rates.of(components)

    resident_need, model_need = _resident_peak(components), _model_peak(components, groups)
    chosen = strategy
    if chosen is None:
        # resident and model-level offload keep every weight in RAM too: not beyond a host budget
        in_ram = _host_bytes(host_memory) is None or sum(c.total_bytes for c in components) <= _host_bytes(host_memory)
        if resident_need <= budget and in_ram:
            chosen = "resident"
        elif model_need <= budget and in_ram:
            chosen = "model"
        else:
            chosen = layered
            if model_need <= budget:
                notes.append(f"model-level offload would fit the device, but keeps all {size(sum(c.total_bytes for c in components))} "
                             f"of weights in RAM, over host_memory={size(_host_bytes(host_memory))}: layerwise streams "
                             "what RAM cannot hold from disk")
        if chosen in ("resident", "model") and resident_blocks != "auto":
            notes.append(f"resident_blocks={resident_blocks} unused: the budget allows {chosen} placement")
    world = world_size if chosen == "distributed" else 1
    if chosen == "model":
        if model_need > budget:
            raise OffloadConfigError(f"device_memory={size(budget)} is below the {size(model_need, up=True)} "
                                     "model-level offload needs (its largest group and that group's activations)")
        parts = [_component_plan(c, SWAPPED, prefetch_depth) for c in components]
        peaks = [_model_phase_peak(components, groups, p, budget) for p in phased]
        peak, min_budget = max(peaks), model_need
    elif chosen == "resident":
        parts = [_component_plan(c, RESIDENT, prefetch_depth, held=c.total_bytes) for c in components]
        states = [_State(c, RESIDENT) for c in components]
        peaks = [_phase_peak(states, p, prefetch_depth) for p in phased]
        peak = resident_need
        min_budget = min(resident_need, model_need,
                         _layerwise(components, phased, 0, prefetch_depth, "auto", world_size, rates, steps,
                                    host_memory, pinned_memory)[1])
    else:
        if relayout is not None:  # the layout that runs, its parked components' kept blocks sized again
            states, floor = _resized(components, phased, budget, prefetch_depth, steps, relayout), 0
        else:
            states, floor = _layerwise(components, phased, budget, prefetch_depth, resident_blocks, world, rates,
                                       steps, host_memory, pinned_memory)
        smallest = floor if strategy is not None else min(floor, model_need)
        if floor > budget:
            raise OffloadConfigError(
                f"device_memory={size(budget)} is too small: the smallest budget that works is "
                f"{size(smallest, up=True)} "
                f"({STRATEGIES[layered if smallest == floor else 'model'].words}"
                + (", every block streamed" if smallest == floor else "") + ")")
        parts = [_component_plan(s.component, s.mode, prefetch_depth, s.kept, s.held(prefetch_depth),
                                 s.slot_bytes(prefetch_depth), s.parks) for s in states]
        peaks = [_phase_peak(states, p, prefetch_depth) for p in phased]
        peak, min_budget = max(peaks), smallest
    return _finish(components, parts, notes, strategy=chosen, chosen_by="flag" if strategy is not None else "budget",
                   budget=budget, asked_budget=asked, device_total=device_total, device_peak=peak,
                   min_budget=min_budget, prefetch_depth=prefetch_depth, world_size=world_size,
                   host_memory=host_memory, pinned_memory=pinned_memory, bandwidth_source=bandwidth_source,
                   phases=phased if phases else (), phases_source=phases_source, peaks=peaks, steps=steps,
                   rates=rates, groups=tuple(tuple(g) for g in groups))


def _model_phase_peak(components: Sequence[Component], groups: Sequence[Sequence[str]], phase: Phase,
                      budget: int | None = None) -> int:
    return group_peak({c.name: (c.total_bytes, c.activation) for c in components}, groups, phase.components, budget)


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
    phases: Sequence[Phase] | None = None,
    phases_source: str | None = None,
    steps: int = 1,
) -> Plan:
    """The plan of what a strategy flag does without a device budget: ``layout`` gives each
    component's mode (resident, streamed, staged, swapped) and resident blocks as the strategy
    set them up; the figures (device bytes held and at the peak, host tiers, bytes copied per
    forward) are the planner's, by the same rules as :func:`make_plan`'s. Nothing parks without a
    budget."""
    if strategy == "distributed":
        prefetch_depth = DISTRIBUTED_DEPTH
    notes: list[str] = []
    phased = _phases_of(components, phases)
    if strategy == "model":
        groups = [list(g) for g in groups] if groups is not None else [[c.name] for c in components]
        parts = [_component_plan(c, SWAPPED, prefetch_depth) for c in components]
        peaks = [_model_phase_peak(components, groups, p) for p in phased]
        peak = _model_peak(components, groups)
        if len(groups) > 1:
            notes.append("the next group is prefetched beside the running one when the device has room for both: "
                         "the peak may then reach two groups (a device_memory budget keeps it within the budget)")
    else:
        states = [_State(c, *layout[c.name], world=world_size if strategy == "distributed" else 1)
                  for c in components]
        parts = [_component_plan(s.component, s.mode, prefetch_depth, s.kept, s.held(prefetch_depth),
                                 s.slot_bytes(prefetch_depth)) for s in states]
        peaks = [_phase_peak(states, p, prefetch_depth) for p in phased]
        peak = max(peaks)
    return _finish(components, parts, notes, strategy=strategy, chosen_by="flag", budget=None, asked_budget=None,
                   device_total=device_total, device_peak=peak, min_budget=None, prefetch_depth=prefetch_depth,
                   world_size=world_size, host_memory=host_memory, pinned_memory=pinned_memory,
                   bandwidth_source="given", phases=phased if phases else (), phases_source=phases_source,
                   peaks=peaks, steps=steps, rates=Rates.of(components),
                   groups=tuple(tuple(g) for g in groups) if groups else ())


def _finish(components: Sequence[Component], parts: list[ComponentPlan], notes: list[str], *, strategy: str,
            world_size: int, host_memory: object, pinned_memory: object, phases: Sequence[Phase],
            peaks: Sequence[int], steps: int, rates: Rates, **plan) -> Plan:
    """The :class:`Plan` of ``parts``, with its host tiers, its phases' figures and the notes every
    plan shares."""
    if any(c.activation_source == "estimate" for c in components):
        notes.append("activation headroom is an estimate (each component's largest block, or all its weights "
                     "without blocks): activation_memory= (--activation-memory) gives the real figure")
    elif any(c.activation_source == "config" for c in components):
        notes.append("activation headroom is estimated from each component's config and the call's shape; the first "
                     "call measures it (activation_memory= gives it)")
    if strategy == "distributed":
        notes.append(f"distributed over {world_size} ranks: each rank's device holds the plan above; with "
                     "shard_host_weights=True (the default) each rank's host keeps 1/N of each streamed block")
    host_budget, host_source = None, None
    if strategy != "resident":  # with no offload, the weights have no host copy
        parts, host_note = host_tiers(parts, components, host_memory, pinned_memory, world_size)
        notes.extend([host_note] if host_note else [])
        host_budget, host_source = _host_budget(host_memory)
    phased = phase_plans(parts, components, phases, plan["prefetch_depth"], rates, steps, peaks) if phases else ()
    if phased and rates.compute_unknown(components):
        notes.append("block compute times unknown: a phase's time is its copying and reading alone (the time a "
                     "copy-bound run takes; --block-compute-ms adds compute)")
    bandwidths = {c.copy_bandwidth for c in components if c.copy_bandwidth}
    return Plan(strategy=strategy, bandwidth=max(bandwidths) if bandwidths else None, components=tuple(parts),
                notes=tuple(notes), phases=phased, steps=steps if phases else None,
                disk_bandwidth=rates.disk if phases else None, disk_bandwidth_source=rates.disk_source if phases else None,
                host_budget=host_budget, host_budget_source=host_source, **plan)


def _host_bytes(host_memory: object) -> int | None:
    return _host_budget(host_memory)[0]


def _host_budget(host_memory: object) -> tuple[int | None, str | None]:
    """The RAM the host tiers were planned for, and where that figure comes from."""
    if host_memory is None:
        return None, None
    from ..common.config import parse_budget
    from ..hostmem.machine import physical_memory

    parsed = parse_budget(host_memory)
    total = physical_memory()
    return parsed.resolve(total), "given" if parsed.fraction is None else f"{parsed.fraction:g} of RAM"


def clamp_note(asked: int, free: int, total: int | None) -> str:
    """What a plan says of a budget above the device's usable memory: both figures, in words and
    in bytes (a 24 GB card has less than "24GiB" free, and one decimal cannot show by how much)."""
    of = f" of {size(total)}" if total else ""
    return (f"device_memory={size(asked)} ({asked} bytes) is more than the device's usable memory, {size(free)} "
            f"({free} bytes) free{of}: the plan uses {size(free)}; give at most that to plan for it exactly")


