"""Layerwise offload of every model in the supported table gives the resident model's output
exactly, over several consecutive forwards, within the bounded device residency."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.discovery import declared_attrs, find_blocks
from offload_core.weights.unit import ALIGN_BYTES

from denoisers import TRANSFORMERS, build_transformer
from standins import STANDINS, build_standin
from tools.supported_models import ROWS
from helpers import chaos_backend, exact_accounting, forward

MODELS = [("transformer" if name in TRANSFORMERS else "standin", name) for row in ROWS for name in row.tiny_models]


def build(kind: str, name: str):
    return build_transformer(name) if kind == "transformer" else build_standin(name)


def spec(kind: str, name: str):
    return (TRANSFORMERS if kind == "transformer" else STANDINS)[name]


def perturbed(inputs: dict, step: int) -> dict:
    """The same call with the floating inputs shifted, as successive denoising steps would be."""
    return {k: (v + 0.1 * step if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in inputs.items()}


@pytest.mark.parametrize("kind,name", MODELS, ids=[n for _, n in MODELS])
def test_registry_names_the_real_block_lists(kind, name):
    model, _ = build(kind, name)
    assert declared_attrs(model) is not None, f"{type(model).__name__} is not in the block registry"
    for attr in spec(kind, name).block_attrs:
        assert attr in declared_attrs(model), f"{attr} of {type(model).__name__} is not streamed"


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("kind,name", MODELS, ids=[n for _, n in MODELS])
def test_layerwise_equals_resident(kind, name, depth):
    model, inputs = build(kind, name)
    model.eval()
    largest, tensors_per_block = _largest_block_bytes(model)
    steps = 3
    expected = [forward(model, perturbed(inputs, s)) for s in range(steps)]
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend, prefetch_depth=depth)
    part = handle.parts[0]
    blocks = len(find_blocks(model))
    assert handle.strategy == "layerwise"
    assert part.num_slots == min(depth, blocks - 1) + 1
    for s in range(steps):
        assert torch.equal(forward(model, perturbed(inputs, s)), expected[s]), f"step {s} differs"
    stats = handle.stats()
    assert stats["prefetch_misses"] == 0
    # each slot holds the largest block of each dtype, measured on the model itself (up to alignment)
    slot = {dtype: n * dtype.itemsize for dtype, n in part.slot_shape.items()}
    assert slot.keys() == largest.keys()
    for dtype, nbytes in largest.items():
        assert nbytes <= slot[dtype] <= nbytes + ALIGN_BYTES * tensors_per_block, dtype
    tensors = _unique_tensors(model)
    model_bytes = sum(t.numel() * t.element_size() for t in tensors)
    weights = part.resident_bytes + part.num_slots * part.slot_bytes
    if exact_accounting():
        # bounded residency, measured by the fake's accounting: exactly resident + slots x largest block
        assert stats["device_peak_bytes"] == weights
        assert model_bytes <= stats["pinned_host_bytes"] <= model_bytes + ALIGN_BYTES * len(tensors)
    else:
        assert stats["device_peak_bytes"] >= weights and stats["pinned_host_bytes"] >= model_bytes
    handle.disable()
    assert torch.equal(forward(model, inputs), expected[0])


def _largest_block_bytes(model) -> tuple[dict[torch.dtype, int], int]:
    """Per dtype, the bytes of the largest block's own tensors (not shared with another block or
    the rest of the model), read from the model before offloading; and the most tensors a block has."""
    blocks = [block for _, block in find_blocks(model)]
    place: dict[int, set[int]] = {}  # storage -> where it is reachable: block index, or -1 outside
    storages: dict[int, torch.Tensor] = {}
    inside = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
    for module in model.modules():
        for t in [*module._parameters.values(), *module._buffers.values()]:
            if t is not None and t.numel():
                key = t.untyped_storage().data_ptr()
                place.setdefault(key, set()).add(inside.get(id(module), -1))
                storages[key] = t
    per_block = [dict[torch.dtype, int]() for _ in blocks]
    counts = [0] * len(blocks)
    for key, places in place.items():
        if len(places) == 1 and (i := next(iter(places))) >= 0:
            t = storages[key]
            per_block[i][t.dtype] = per_block[i].get(t.dtype, 0) + t.untyped_storage().nbytes()
            counts[i] += 1
    dtypes = {d for b in per_block for d in b}
    return {d: max(b.get(d, 0) for b in per_block) for d in dtypes}, max(counts)


def _unique_tensors(model):
    seen = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[id(t)] = t
    return list(seen.values())
