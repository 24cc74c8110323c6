"""``enable_offload``: the one entry point that turns offloading on."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING, Any, Sequence

from torch import nn

from . import ownership
from .backend import DeviceBackend
from .config import OffloadConfig
from .discovery import find_blocks
from .discovery.blocks import no_blocks_hint
from .errors import AlreadyEnabledError, OffloadConfigError
from .foreign import refuse_weight_hook_methods, weight_hooks
from .handle import HANDLE_ATTRIBUTE, OffloadHandle
from .hostmem.placement import plan_placement
from .pipelines import enable_on_pipeline, is_pipeline
from .plugins import get_backend
from .strategies.common import Transaction
from .strategies import streaming_part
from .strategies.distributed import agreement
from .strategies.model_level import ModelLevelOffload
from .strategies.part import attach
from .strategies.resident import ResidentModules

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

logger = logging.getLogger(__name__)


def enable_offload(
    target: Any,
    config: OffloadConfig | None = None,
    *,
    enable_cpu_offload: bool = False,
    enable_layerwise_offload: bool = False,
    enable_distributed_layerwise_offload: bool = False,
    backend: str | DeviceBackend | None = None,
    pin_memory: bool = True,
    prefetch_depth: int = 1,
    process_group: ProcessGroup | None = None,
    shard_host_weights: bool = True,
    components: Sequence[str] | None = None,
    blocks: Sequence[str] | None = None,
    pinned_memory: int | float | str | None = None,
    host_memory: int | float | str | None = None,
    offload_folder: str | os.PathLike | None = None,
    device_memory: int | float | str | None = None,
    resident_blocks: int | str | None = None,
    activation_memory: int | str | None = None,
    **unknown: Any,
) -> OffloadHandle:
    """Turn on offloading for a diffusers pipeline or any ``torch.nn.Module``.

    The options are the fields of :class:`OffloadConfig` (documented there and in
    ``docs/index.md``), given as keywords or as ``config=`` (not both: a keyword left at its
    default counts as not given). One strategy flag selects the strategy (distributed >
    layerwise > model-level); an option the selected strategy does not use is an error, and a
    name that is no option is an :class:`OffloadConfigError` listing the valid ones.

    ``enable`` is a transaction: on any error the target is left as it was. What an offloaded
    model does when it is changed, shared or fails is in ``docs/design.md``.
    """
    kind = "pipeline" if is_pipeline(target) else "module" if isinstance(target, nn.Module) else None
    if kind is None:
        raise OffloadConfigError(
            f"target must be a diffusers pipeline or a torch.nn.Module, got {type(target).__name__}"
        )
    config = resolve_config(config, given_options(locals(), unknown))
    config.warn_ignored()
    config.check_applies(kind)
    return enable_checked(target, kind, config)


def given_options(arguments: dict[str, Any], unknown: dict[str, Any]) -> dict[str, Any]:
    """The options of a call's keyword-only ``arguments`` (its ``locals()``) that differ from
    their defaults (an identical object), and the ``unknown`` names, which the config refuses."""
    defaults = {f.name: f.default for f in dataclasses.fields(OffloadConfig)}
    given = {name: arguments[name] for name, default in defaults.items() if arguments[name] is not default}
    return {**given, **unknown}


def resolve_config(config: OffloadConfig | None, options: dict[str, Any]) -> OffloadConfig:
    """The validated config of ``config=`` or keyword ``options``, with a strategy selected."""
    if config is not None and options:
        raise OffloadConfigError(f"pass either config= or keyword options, not both (got {', '.join(options)})")
    if config is None:
        config = OffloadConfig.from_options(options)
    elif not isinstance(config, OffloadConfig):
        raise OffloadConfigError(f"config must be an offload_core.OffloadConfig, got {type(config).__name__}")
    if config.strategy is None:
        raise OffloadConfigError(
            "no strategy selected: set enable_cpu_offload, enable_layerwise_offload or "
            "enable_distributed_layerwise_offload"
        )
    return config


def enable_checked(target: Any, kind: str, config: OffloadConfig) -> OffloadHandle:
    """``enable_offload`` once ``config`` has been checked against ``kind`` of target ("pipeline"
    or "module"), as ``from_pretrained`` does before it loads anything."""
    existing = getattr(target, HANDLE_ATTRIBUTE, None)
    if existing is not None:
        raise AlreadyEnabledError(
            f"offloading is already enabled on this {type(target).__name__} by {existing!r}; call handle.disable() "
            "first (again, if an earlier disable() was interrupted)"
        )
    ownership.check_free(_roots(target), f"this {type(target).__name__}")
    foreign = _foreign_offload(target)
    if foreign:
        raise OffloadConfigError(
            f"{foreign} already manages this model's placement; remove it first "
            "(pipe.remove_all_hooks() for accelerate, or load the model again)"
        )
    backend = get_backend(config.backend)
    if kind == "pipeline":
        handle = enable_on_pipeline(target, config, backend)
    else:
        handle = _enable_on_module(target, config, backend)

    roots, undo_refusal = _roots(target), []  # diffusers' weight-hook methods refused meanwhile

    def mark(on: bool) -> None:  # taken off while a plain copy is made, so the copy is not "enabled"
        if on:
            setattr(target, HANDLE_ATTRIBUTE, handle)
            undo_refusal.append(refuse_weight_hook_methods(roots))
        else:
            target.__dict__.pop(HANDLE_ATTRIBUTE, None)
            while undo_refusal:
                undo_refusal.pop()()

    mark(True)
    handle._instruments.append(mark)
    handle._undo.append(lambda: mark(False))
    ownership.register(handle)
    return handle


def _foreign_offload(target: Any) -> str | None:
    """The other library whose hooks manage ``target``'s weights, if any: two libraries moving
    the same weights would fight over them. diffusers' caches and other hooks that leave the
    weights alone run on top of offload (:mod:`.foreign`)."""
    return weight_hooks(_roots(target))


def _roots(target: Any) -> list[nn.Module]:
    return [m for m in target.components.values() if isinstance(m, nn.Module)] if is_pipeline(target) else [target]


def _enable_on_module(module: nn.Module, config: OffloadConfig, backend) -> OffloadHandle:
    baseline = backend.memory_allocated()
    backend.reset_peak_memory_stats()
    handle = OffloadHandle(module, config.strategy, backend, baseline=baseline, config=config)
    with Transaction() as txn, agreement(config) as agreed:
        if config.strategy in ("layerwise", "distributed"):
            blocks = find_blocks(module, config.blocks)
            if blocks:
                part = streaming_part(module, blocks, config, backend)
            else:
                logger.info("%s offload: %s has no blocks to stream, so it stays resident on the device; %s",
                            config.strategy, type(module).__name__, no_blocks_hint(module))
                part = ResidentModules([(type(module).__name__, module)], backend)
        else:
            part = ModelLevelOffload.for_module(module, backend)
        agreed.parts = [part]
        handle.placement = plan_placement([part], config, backend)
        handle.placement.attach([part], txn)
        attach(part, handle)
        part.enable(txn)
    handle.parts = [part]
    return handle
