"""The enable transaction: one path from a checked config to a live handle, for a module and a
pipeline alike.

In order: refuse a target that is offloaded already (or shares a module or parameter with one) or
whose weights another library's hooks manage; choose the parts (one path: a module is a pipeline
of one component, laid out by :mod:`offload_core.discovery.pipelines` as a pipeline's are); place
their homes (where they live); enable each part; put the installs on the target (a pipeline's
subclass, the handle mark with diffusers' weight-hook methods refused); hand all of it to the
handle in one call (:meth:`OffloadHandle.open`); record what the handle owns
(:mod:`offload_core.common.changes`). Any error on the way rolls every step back and leaves the
target as it was. A distributed enable (where ranks exist) runs inside the distributed agreement,
so that a rank that fails makes every rank roll back.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from ..common import changes
from ..interop.casting import CastingHooks, cast_for_storage, check_casting
from ..common.config import OffloadConfig
from ..device.backend import DeviceBackend
from ..device.plugins import get_backend
from ..base.errors import AlreadyEnabledError, OffloadConfigError
from ..planning.fitting import Fit, describe_parts, fit, out_of_memory
from ..handle import HANDLE_ATTRIBUTE, OffloadHandle
from ..hostmem.placement import place_homes
from .installs import Mark, PipelineClass
from ..interop.other_hooks import weight_hooks
from ..discovery.pipelines import Inventory, layerwise_layout
from ..strategies import streaming_part
from ..common.transaction import Transaction
from ..strategies.distributed import agreement
from ..strategies.model_level import ModelLevelOffload
from ..strategies.phases import phase_switch
from ..strategies.resident import ResidentModules


def enable(target: Inventory, config: OffloadConfig) -> OffloadHandle:
    """Offload ``target`` (a diffusers pipeline or a module, as the inventory ``enable_offload``
    made of it) under ``config``. A strategy a flag selected comes checked against the kind of
    target (``OffloadConfig.check_applies``, by the caller, before anything happens); one the
    device budget chooses is checked here, once the plan has chosen it."""
    _refuse_taken(target.target, list(target.roots))
    backend = get_backend(config.backend)
    if config.storage_dtype is not None:  # first: the plan measures the weights as they are stored
        cast_for_storage([(n, m) for n, m in target.modules if target.kinds[n] == "dit"], config.storage_dtype)
    fitted = fit(target, config, backend)  # before anything moves: an impossible budget is an error
    if fitted is not None:
        # a strategy the budget chose (a flag's was checked before): its options must apply to it
        if config.strategy is None and fitted.config.strategy is not None:
            fitted.config.check_applies(target.kind)
        config = fitted.config
    try:
        handle = _open(target, config, backend, fitted)
    except torch.OutOfMemoryError as exc:  # rolled back: say which budget the device could not hold
        raise out_of_memory(exc, fitted.plan if fitted is not None else None, config.strategy, backend) from exc
    return handle


def _open(target: Inventory, config: OffloadConfig, backend: DeviceBackend, fitted: Fit | None) -> OffloadHandle:
    """The transaction itself: parts, homes, installs, the handle; all of it or, on any error,
    none (and once this frame is gone, nothing of the parts is left referenced). Across ranks it
    runs inside the distributed agreement, so that a rank that fails makes every rank roll back."""
    baseline = backend.memory_allocated()
    backend.reset_peak_memory_stats()
    ranks = agreement(config) if config.strategy == "distributed" else None
    with Transaction() as txn, ranks or contextlib.nullcontext():
        # the parts of the components (a module is a pipeline of one DiT): layerwise streams the
        # chosen ones (or those the plan streams, keeping its resident blocks on the device), stages
        # those without blocks and keeps the rest resident (layerwise_layout); model-level swaps
        # their groups (a module's one group is staged: nothing runs beside it to prefetch for)
        modules = target.components()
        if config.strategy != "model":
            modes = {name: fitted.mode(name) for name, _ in modules} if fitted is not None else None
            layout = layerwise_layout(target, config, modes)
            parts = []
            for name, module, blocks in layout.streamed:
                kept = fitted.kept(name) if fitted is not None else ()
                parts.append(streaming_part(module, blocks, config, backend, kept))
                parts[-1].label = name  # the timeline names blocks "transformer_2.blocks.3"
                parts[-1].once_per_call = target.kinds[name] != "dit"
                parts[-1].parks = fitted is not None and fitted.parks(name)
            if layout.staged:
                parts.append(ModelLevelOffload(layout.staged, backend, prefetch=False))
            if layout.resident:
                parts.append(ResidentModules(layout.resident, backend))
        else:
            budget = {} if fitted is None else dict(
                device_limit=fitted.plan.budget, reserved={c.name: c.activation_bytes for c in fitted.plan.components})
            parts = [ModelLevelOffload(target.swap_groups(), backend, prefetch=target.pipeline, **budget)]
        if ranks is not None:
            ranks.parts = parts
        check_casting(target.roots, parts)
        # without a budget, the plan of what the strategy flag set up
        plan = fitted.plan if fitted is not None else describe_parts(target, config, backend, parts)
        handle = OffloadHandle(target.target, config, backend, baseline=baseline, plan=plan,
                               replan=fitted.replan if fitted is not None else None)
        placement = place_homes(parts, config, backend)
        placement.attach(parts, txn)
        for part in parts:
            part.join(handle)
            part.enable(txn)
        installs: list = []
        if target.pipeline:
            installs.append(PipelineClass(target.target, handle, parts, dict(target.modules)))
        installs.append(Mark(target.target, list(target.roots), handle))
        installs.append(CastingHooks(list(target.roots), handle))
        for install in installs:
            txn.on_rollback(install.uninstall)  # first: an install that fails half-way is undone too
            install.install()
        switch = None
        if any(p.parks for p in plan.components):  # a part that runs in a phase tells the switch when it begins
            switch = phase_switch(parts, plan)
            for part in parts:
                part.switch = switch
        handle.open(parts, placement, installs, switch)
        txn.on_rollback(functools.partial(changes.unregister, handle))
        changes.register(handle)
    return handle


def _refuse_taken(target: Any, roots: list[nn.Module]) -> None:
    """A target that already has a handle, contains or is contained in an offloaded model, or whose
    weights another library's hooks move: two owners of the same weights would fight over them.
    diffusers' caches and other hooks that leave the weights alone run on top of offload
    (:mod:`offload_core.interop.other_hooks`)."""
    existing = getattr(target, HANDLE_ATTRIBUTE, None)
    if existing is not None:
        raise AlreadyEnabledError(
            f"offloading is already enabled on this {type(target).__name__} by {existing!r}; call handle.disable() "
            "first (again, if an earlier disable() was interrupted)"
        )
    changes.check_free(roots, f"this {type(target).__name__}")
    other = weight_hooks(roots)
    if other:
        raise OffloadConfigError(
            f"{other} already manages this model's placement; remove it first "
            "(pipe.remove_all_hooks() for accelerate, or load the model again)"
        )
