"""Plan inputs from torch modules: a model or a pipeline's components, on any device, meta included.

Blocks are the ones layerwise offload streams (``offload_core.discovery.find_blocks``). A model
in memory, or on the meta device with a checkpoint behind it (``from_pretrained``), is measured by
the packer itself (``weights.split_units``): the bytes are those of the units it would stream,
alignment included, so that the plan's bytes are the ones copied. A model on the meta device
with no checkpoint (a real-size config) is measured from its parameters and buffers, each tensor
counted once however many modules share it, and a tensor used by two blocks, or by a block and
the rest of the model, counted as resident, as the packer keeps it.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from torch import nn

from ..discovery import find_blocks
from ..base.errors import BlockDiscoveryError, UnsupportedTensorError
from ..weights import WeightUnit, split_units
from ..weights.owners import collect_tensors
from .activations import estimate, latent_factors
from .components import CallShape, Component


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


def component_from_module(name: str, module: nn.Module, kind: str = "dit",
                          blocks: Iterable[str] | None = None) -> Component:
    """The :class:`Component` of ``module``: ``blocks`` are block attribute names overriding discovery
    (as ``enable_offload(blocks=...)``); a model whose block stack cannot be found has none."""
    everything = _tensors(module)
    try:
        found = find_blocks(module, blocks)
    except BlockDiscoveryError:
        if blocks is not None:
            raise
        found = []
    try:  # the packer's own units: their sizes include the alignment of every region
        return component_from_split(name, module, kind, *split_units(module, found, report=False))
    except UnsupportedTensorError:  # meta tensors with no checkpoint behind them: a real-size config
        pass
    per_block = [_tensors(block) for _, block in found]
    outside = _outside(module, {id(block) for _, block in found})
    owners: dict[int, int] = dict.fromkeys(outside, 1)
    for tensors in per_block:
        for key in tensors:
            owners[key] = owners.get(key, 0) + 1
    block_bytes = tuple(sum(b for key, b in tensors.items() if owners[key] == 1) for tensors in per_block)
    return Component(name, kind, sum(everything.values()) - sum(block_bytes), block_bytes)


def component_from_split(name: str, module: nn.Module, kind: str, resident: WeightUnit,
                         units: Sequence[WeightUnit]) -> Component:
    """The :class:`Component` of ``module`` as the packer split it (``split_units``: its resident
    weights and its blocks' units), so that a part that has split it already is not split again."""
    whole = WeightUnit(name, collect_tensors([module]), report=False)  # as it is kept resident, staged or swapped
    return Component(name, kind, resident.nbytes, tuple(u.nbytes for u in units), unit_bytes=whole.nbytes)


def components_from_modules(modules: Sequence[tuple[str, nn.Module]], kinds: Mapping[str, str],
                            blocks: Iterable[str] | None = None, shape: CallShape | None = None,
                            guidance_batch: int = 1) -> list[Component]:
    """The components of a pipeline's ``(name, module)`` pairs, in that order, each of its kind in
    ``kinds`` ("dit", "text_encoder", "vae", "other": ``discovery.pipelines.component_kind``);
    ``blocks`` overrides the DiTs' block discovery, as ``enable_offload(blocks=...)`` does. With a
    call ``shape`` (and ``guidance_batch``: the batch guidance adds to each DiT forward), each
    component's activation headroom is estimated from its config (:mod:`.activations`). This
    module does not import ``offload_core.discovery.pipelines``, so the enable path can call it."""
    vae = next((module for name, module in modules if kinds[name] == "vae"), None)
    factors = latent_factors(vae)
    components = []
    for name, module in modules:
        attrs = blocks if kinds[name] == "dit" else None
        component = component_from_module(name, module, kinds[name], attrs)
        found = [block for _, block in _blocks_or_none(module, attrs)]
        estimated = estimate(kinds[name], module, found, shape, factors, guidance_batch)
        if estimated is not None:
            component = component.with_measurements(activation_bytes=estimated, activation_from="config")
        components.append(component)
    return components


def _blocks_or_none(module: nn.Module, attrs: Iterable[str] | None) -> list[tuple[str, nn.Module]]:
    try:
        return find_blocks(module, attrs)
    except BlockDiscoveryError:
        return []
