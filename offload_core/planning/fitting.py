"""A device budget at enable: the planner's plan (planning/) made from the target itself, and
what it decides for the enable transaction (enable.py): the strategy, which components stream,
are staged or stay resident, and which blocks of a streamed component stay on the device.

The plan is made before anything moves, so a budget nothing fits in is an error naming the
smallest budget that works, and the target is untouched. A budget above the device's usable
memory (``mem_get_info``'s free bytes) is clamped to it with a warning naming both: a 24 GB card
has less than ``"24GiB"`` free, and its owner means "all of my card". Without ``device_memory``
and ``resident_blocks`` the strategy flags alone decide, and :func:`describe_parts` makes the plan
of what they set up, so that every handle has one.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
import warnings
from typing import Any, Sequence

import torch
from torch import nn

from ..common.config import STRATEGIES, OffloadConfig
from ..device.backend import DeviceBackend
from ..base.errors import OffloadConfigError
from ..discovery.pipelines import Inventory, pipeline_inventory
from . import Plan, describe, make_plan
from .components import CallShape
from .phases import OBSERVED, guidance_batch, observed, pipeline_phases
from .plan import RESIDENT, STAGED, STREAMED, SWAPPED, size
from .modules import component_from_split, components_from_modules

logger = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class Fit:
    """A plan and the config it implies: the chosen strategy's flag set (none for "resident")."""

    plan: Plan
    config: OffloadConfig
    replan: Any = None  # measured activations (component -> bytes) -> the plan made with them

    def mode(self, name: str) -> str:
        return self.plan.component(name).mode

    def kept(self, name: str) -> tuple[int, ...]:
        return self.plan.component(name).resident_blocks

    def parks(self, name: str) -> bool:
        return self.plan.component(name).parks


def fit(target: Inventory, config: OffloadConfig, backend: DeviceBackend) -> Fit | None:
    """The plan of ``target`` under ``config``'s ``device_memory`` (the device's free memory when
    only ``resident_blocks`` is given, and at most that), or None when neither is set."""
    if config.device_budget.auto and config.resident_blocks is None:
        return None
    inputs = plan_inputs(target, config.blocks)
    components = inputs.components
    if config.activation_memory is not None:
        components = [c.with_measurements(activation_bytes=config.activation_memory, activation_from="given")
                      for c in components]
    free, total = backend.mem_get_info()
    options = dict(device_total=total, device_free=free, groups=inputs.groups,
                   resident_blocks="auto" if config.resident_blocks is None else config.resident_blocks,
                   prefetch_depth=config.prefetch_depth, world_size=_world(config), host_memory=config.host_memory,
                   pinned_memory=config.pinned_memory, phases=inputs.phases, phases_source=inputs.phases_source,
                   steps=inputs.steps)
    budget = free if config.device_budget.auto else config.device_memory
    plan = make_plan(components, budget, strategy=config.strategy, **options)
    if plan.asked_budget > plan.budget:
        warnings.warn(plan.notes[0], UserWarning, stacklevel=4)
    logger.info("device plan for %s:\n%s", type(target.target).__name__, plan.render())
    flag = STRATEGIES[plan.strategy].flag
    chosen = dataclasses.replace(config, **({flag: True} if flag and config.strategy is None else {}))
    if config.strategy is None and plan.strategy not in ("layerwise", "distributed"):
        # picked by the budget only because every weight fits in host_memory: nothing left to bound
        chosen = dataclasses.replace(chosen, host_memory=None)

    def replan(measured: dict[str, int], block_seconds: dict[str, float], copy_bandwidth: float | None,
               seen: tuple[list[str], int] | None, parking: set[str]) -> Plan:
        """The plan of the same budget and layout with the activations a first call measured (an
        activation given by ``activation_memory=`` is kept), its blocks' compute times, the rate
        its copies ran at and the phases it had (``seen``: the order its components began their
        forwards in, and its steps): only the kept blocks of the components that still park
        (``parking``: the others stopped, see strategies/phases.py) are sized (and placed among
        the streamed ones) again."""
        again = [c if c.activation_from == "given" and c.activation_bytes is not None or c.name not in measured
                 else c.with_measurements(activation_bytes=measured[c.name], activation_from="measured")
                 for c in components]
        again = [c.with_measurements(block_compute_s=block_seconds[c.name],
                                     copy_bandwidth=c.copy_bandwidth or copy_bandwidth) if c.name in block_seconds else c
                 for c in again]
        phases = {}
        if seen is not None:  # the phases the call had: in the order its components began their forwards
            order, steps = seen
            phases = dict(phases=observed(order, target.kinds, steps), phases_source=OBSERVED, steps=steps or 1)
        layout = [dataclasses.replace(c, parks=c.parks and c.name in parking) for c in plan.components]
        again = make_plan(again, plan.budget, strategy=plan.strategy, relayout=layout,
                          **{**options, "device_free": None, **phases})
        return dataclasses.replace(again, chosen_by=plan.chosen_by, min_budget=plan.min_budget,
                                   asked_budget=plan.asked_budget, notes=plan.notes)

    # a layout that can change between calls: layerwise parts that park (their kept blocks are loaded
    # at each switch anyway)
    return Fit(plan, chosen, replan if plan.strategy == "layerwise" and any(c.parks for c in plan.components)
               else None)


def describe_parts(target: Inventory, config: OffloadConfig, backend: DeviceBackend, parts: Sequence[Any]) -> Plan:
    """The plan of what the strategy flag set up without a device budget: each component's mode
    and resident blocks read from ``parts`` (built, nothing moved yet), its figures the planner's.
    A streamed component is measured by its part's own units (the packer has split it already);
    the others as the planner measures any module."""
    world = _world(config)
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    split: dict[str, Any] = {}
    for part in parts:
        if hasattr(part, "kept_names"):  # a streamed component (layerwise, distributed)
            layout[part.label] = (STREAMED, tuple(part.all_names.index(n) for n in part.kept_names))
            split[part.label] = part
        elif hasattr(part, "groups"):  # model-level: swapped, or staged around its use (prefetch off)
            layout.update({c.name: (SWAPPED if part.prefetch else STAGED, ()) for g in part.groups
                           for c in g.components})
        else:
            layout.update({name: (RESIDENT, ()) for name, _ in part.members})
    inputs = plan_inputs(target, config.blocks)
    measured = {c.name: c for c in inputs.components}
    components = [
        component_from_split(name, module, target.kinds[name], split[name].resident, split[name].block_units)
        .with_measurements(activation_bytes=measured[name].activation_bytes,
                           activation_from=measured[name].activation_from)
        if name in split else measured[name]
        for name, module in target.components()
    ]
    return describe(components, layout, config.strategy, device_total=backend.mem_get_info()[1], groups=inputs.groups,
                    prefetch_depth=config.prefetch_depth, world_size=world, host_memory=config.host_memory,
                    pinned_memory=config.pinned_memory, phases=inputs.phases, phases_source=inputs.phases_source,
                    steps=inputs.steps)


def out_of_memory(exc: BaseException, plan: Plan | None, strategy: str | None, backend: DeviceBackend
                  ) -> BaseException:
    """The error of an enable that ran out of device memory (rolled back): the allocator's own
    message, with the budget and the plan's predicted peak (``plan``: a budget's), and what to do.
    The failed frames' locals are cleared first: the traceback would otherwise keep the device
    tensors enable had allocated for as long as the error lives (in a notebook, until the next
    error), and the free memory it names would not be what a retry gets."""
    traceback.clear_frames(exc.__traceback__)
    free, total = backend.mem_get_info()
    device = f"the device, which has {size(free)} free of {size(total)} now"
    if plan is None:
        what = (f"{STRATEGIES[strategy].words} offload without a device budget; if the device "
                f"filled ({device}), give device_memory=, and the planner keeps within it")
    else:
        what = (f"device_memory={size(plan.budget)}, planned to peak at {size(plan.device_peak)} on {device}; if "
                "the device filled, other users took memory meanwhile or the allocator needs more than the plan "
                "counts: give a smaller device_memory")
    return torch.OutOfMemoryError(f"enable ran out of memory and was rolled back, the model is as it was ({exc}), "
                                  f"under {what}")


@dataclasses.dataclass(frozen=True)
class PlanInputs:
    """What a plan of a target is made from: its components, its model-level swap groups (None: a
    module), the phases of a call (none for a module: one component, nothing to switch), where
    they come from, and the denoising steps of a call."""

    components: list
    groups: list[list[str]] | None
    phases: tuple = ()
    phases_source: str | None = None
    steps: int = 1


def plan_inputs(target: Inventory, blocks: Any = None) -> PlanInputs:
    """The planner's inputs of ``target`` as enable plans it: the call's shape is not known yet,
    so activations are the planner's estimate until the first call measures them."""
    return _inputs(target, blocks, type(target.target).__name__ if target.pipeline else None)


def pipeline_plan_inputs(pipe: Any, modules: list[tuple[str, nn.Module]], blocks: Any = None, *,
                         cls_name: str | None = None, shape: CallShape | None = None,
                         steps: int | None = None, guidance: bool | None = None) -> PlanInputs:
    """:func:`plan_inputs` of a pipeline's ``(name, module)`` pairs (with ``pipe`` None, each
    component's kind read from its name) of class ``cls_name``, activations estimated at ``shape``,
    calls of ``steps`` steps (default: the pipeline's usual) with or without classifier-free
    ``guidance`` (None: as its usual call); none is no error here, the planner says there is
    nothing to plan."""
    return _inputs(pipeline_inventory(pipe, modules), blocks, cls_name, shape, steps, guidance)


def _inputs(target: Inventory, blocks: Any, cls_name: str | None, shape: CallShape | None = None,
            steps: int | None = None, guidance: bool | None = None) -> PlanInputs:
    """A module is one component: no swap groups, and no phases (nothing to switch between)."""
    if target.pipeline:
        kinds = [(name, target.kinds[name]) for name, _ in target.modules]
        phases, source, usual_steps = pipeline_phases(cls_name, kinds, guidance)
    components = components_from_modules(list(target.modules), target.kinds, blocks, shape,
                                          guidance_batch(cls_name, guidance) if target.pipeline else 1)
    if not target.pipeline:
        return PlanInputs(components, None)
    groups = [[name for name, _ in members] for _, members in target.swap_groups()]
    return PlanInputs(components, groups, phases, source, steps or usual_steps)


def _world(config: OffloadConfig) -> int:
    """The ranks a distributed plan spreads over: with the distributed flag, or with no flag and a
    process group given (the budget then picks distributed when it streams)."""
    if config.strategy not in (None, "distributed") or (config.strategy is None and config.process_group is None):
        return 1
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        if config.strategy == "distributed":
            return 1  # the strategy itself says what is missing
        raise OffloadConfigError("process_group= was given but torch.distributed is not initialised")
    return dist.get_world_size(config.process_group)
