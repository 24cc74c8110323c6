"""A device budget at enable: the planner's plan (planning/) made from the target itself, and
what it decides for the enable transaction (enable.py): the strategy, which components stream,
are staged or stay resident, and which blocks of a streamed component stay on the device.

The plan is made before anything moves, so a budget nothing fits in is an error naming the
smallest budget that works, and the target is untouched. Without ``device_memory`` and
``resident_blocks`` there is no plan, and the strategy flags alone decide.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from .backend import DeviceBackend
from .config import FLAG_PRIORITY, OffloadConfig
from .errors import OffloadConfigError
from .pipelines import component_kind, model_level_groups, pipeline_modules
from .planning import Plan, make_plan
from .planning.modules import components_from_modules

logger = logging.getLogger(__name__)

#: the strategy flag of each strategy a plan can choose ("resident" has none)
FLAGS = {strategy: flag for flag, strategy in FLAG_PRIORITY}


@dataclasses.dataclass(frozen=True)
class Fit:
    """A plan and the config it implies: the chosen strategy's flag set (none for "resident")."""

    plan: Plan
    config: OffloadConfig

    def mode(self, name: str) -> str:
        return self.plan.component(name).mode

    def kept(self, name: str) -> tuple[int, ...]:
        return self.plan.component(name).resident_blocks


def fit(target: Any, pipeline: bool, config: OffloadConfig, backend: DeviceBackend) -> Fit | None:
    """The plan of ``target`` under ``config``'s ``device_memory`` (the device's free memory when
    only ``resident_blocks`` is given), or None when neither is set."""
    if config.device_budget.auto and config.resident_blocks is None:
        return None
    if pipeline:
        modules = pipeline_modules(target)
        if not modules:
            raise ValueError(f"{type(target).__name__} has no component with weights to offload")
        components, groups = plan_inputs(target, modules, config.blocks)
    else:
        components = components_from_modules([(component_name(target), target)],
                                             {component_name(target): "dit"}, config.blocks)
        groups = None
    if config.activation_memory is not None:
        components = [c.with_measurements(activation_bytes=config.activation_memory) for c in components]
    free, total = backend.mem_get_info()
    world = _world(config)
    plan = make_plan(
        components, free if config.device_budget.auto else config.device_memory, device_total=total, groups=groups,
        strategy=config.strategy, resident_blocks="auto" if config.resident_blocks is None else config.resident_blocks,
        prefetch_depth=config.prefetch_depth, world_size=world, host_memory=config.host_memory,
        pinned_memory=config.pinned_memory,
    )
    logger.info("device plan for %s:\n%s", type(target).__name__, plan.render())
    flag = FLAGS.get(plan.strategy)
    chosen = dataclasses.replace(config, **({flag: True} if flag and config.strategy is None else {}))
    return Fit(plan, chosen)


def plan_inputs(pipe: Any, modules: list[tuple[str, nn.Module]], blocks: Any = None) -> tuple[list, list[list[str]]]:
    """The planner's components of a pipeline's ``(name, module)`` pairs, each of its kind (with
    ``pipe`` None, read from the names alone), and the pipeline's model-level swap groups: what
    enable and ``offload-core plan`` both plan from."""
    components = components_from_modules(modules, {name: component_kind(pipe, name) for name, _ in modules}, blocks)
    groups = [[name for name, _ in members] for _, members in model_level_groups(pipe, modules)]
    return components, groups


def component_name(module: nn.Module) -> str:
    """A bare model is the plan's one component, named by its class."""
    return type(module).__name__


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
