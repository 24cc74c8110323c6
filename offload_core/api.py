"""``enable_offload``: the one entry point that turns offloading on."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any, Sequence


from .common.config import OffloadConfig
from .device.backend import DeviceBackend
from .enabling.enable import enable
from .base.errors import OffloadConfigError
from .handle import OffloadHandle
from .discovery.pipelines import inventory

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup


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
    storage_dtype: torch.dtype | None = None,
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
    found = inventory(target)
    if found is None:
        raise OffloadConfigError(
            f"target must be a diffusers pipeline or a torch.nn.Module, got {type(target).__name__}"
        )
    config = resolve_config(config, given_options(locals(), unknown))
    config.warn_ignored()
    if config.strategy is not None:  # else the device budget picks it, and enable checks then
        config.check_applies(found.kind)
    return enable(found, config)


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
    if config.strategy is None and config.device_budget.auto:
        raise OffloadConfigError(
            "no strategy selected: give a device_memory budget (the planner then picks one), or set "
            "enable_cpu_offload, enable_layerwise_offload or enable_distributed_layerwise_offload"
        )
    return config
