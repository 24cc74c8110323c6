"""Offloading strategies: policies deciding which weight units are on the device when."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ..common.config import OffloadConfig
from ..device.backend import DeviceBackend
from .distributed import distributed_part
from .layerwise import LayerwiseOffload


def streaming_part(
    model: nn.Module, blocks: Sequence[tuple[str, nn.Module]], config: OffloadConfig, backend: DeviceBackend,
    kept: Sequence[int] = (),
) -> LayerwiseOffload:
    """The block-streaming strategy ``config`` selects for one model: layerwise or distributed,
    with the blocks ``kept`` (indices into ``blocks``) resident on the device."""
    if config.strategy == "distributed":
        return distributed_part(model, blocks, backend, config.process_group, config.shard_host_weights, kept)
    return LayerwiseOffload(model, blocks, backend, config.prefetch_depth, resident_blocks=kept)
