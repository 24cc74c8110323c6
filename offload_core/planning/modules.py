"""Plan inputs from torch modules: a model or a pipeline's components, on any device, meta included.

Blocks are the ones layerwise offload streams (``offload_core.discovery.find_blocks``); a
component's bytes are its parameters' and buffers' (each tensor counted once, however many
modules share it). A tensor used by two blocks, or by a block and the rest of the model, is not
any one block's: it counts as resident, as the packer keeps it.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

from torch import nn

from ..discovery import find_blocks
from ..errors import BlockDiscoveryError
from .components import Component


def _tensors(module: nn.Module, recurse: bool = True) -> dict[int, int]:
    """``id -> bytes`` of every parameter and buffer of ``module``."""
    return {id(t): t.numel() * t.element_size()
            for t in (*module.parameters(recurse=recurse), *module.buffers(recurse=recurse))}


def _outside(module: nn.Module, blocks: set[int]) -> set[int]:
    """The tensors reachable from ``module`` without entering a block."""
    found, stack, seen = set(), [module], set()
    while stack:
        current = stack.pop()
        if id(current) in seen or id(current) in blocks:
            continue
        seen.add(id(current))
        found.update(_tensors(current, recurse=False))
        stack.extend(current.children())
    return found


def component_from_module(name: str, module: nn.Module, kind: str = "dit", blocks: Iterable[str] | None = None,
                          activation_bytes: int | None = None) -> Component:
    """The :class:`Component` of ``module``: ``blocks`` are block attribute names overriding discovery
    (as ``enable_offload(blocks=...)``); a model whose block stack cannot be found has none."""
    everything = _tensors(module)
    try:
        found = find_blocks(module, blocks)
    except BlockDiscoveryError:
        if blocks is not None:
            raise
        found = []
    per_block = [_tensors(block) for _, block in found]
    outside = _outside(module, {id(block) for _, block in found})
    owners: dict[int, int] = dict.fromkeys(outside, 1)
    for tensors in per_block:
        for key in tensors:
            owners[key] = owners.get(key, 0) + 1
    block_bytes = tuple(sum(b for key, b in tensors.items() if owners[key] == 1) for tensors in per_block)
    return Component(name, kind, sum(everything.values()) - sum(block_bytes), block_bytes, activation_bytes)


def components_from_pipeline(pipe: Any, activation_memory: dict[str, int] | None = None
                             ) -> tuple[list[Component], list[list[str]]]:
    """The components of a diffusers pipeline in their order of use, and its model-level swap groups."""
    from ..pipelines import pipeline_modules

    return components_from_modules(pipe, pipeline_modules(pipe), activation_memory)


def components_from_modules(pipe: Any, modules: Sequence[tuple[str, nn.Module]],
                            activation_memory: dict[str, int] | None = None
                            ) -> tuple[list[Component], list[list[str]]]:
    """As :func:`components_from_pipeline`, for ``(name, module)`` pairs of the pipeline ``pipe``
    (None: a pipeline of no particular class, kinds from the component names alone)."""
    from ..pipelines import component_kind, model_level_groups

    given = activation_memory or {}
    components = [component_from_module(name, module, component_kind(pipe, name), activation_bytes=given.get(name))
                  for name, module in modules]
    groups = [[name for name, _ in members] for _, members in model_level_groups(pipe, list(modules))]
    return components, groups
