"""End to end on tiny real diffusers pipelines: model-level and layerwise offload give the same
images as no offload (same seed, 2 steps), within the device budget, and disable restores."""

from __future__ import annotations


import pytest
import torch

import offload_core
from offload_core.pipelines import component_kind, pipeline_modules
from offload_core import Capability
from offload_core.discovery.support import ROWS
from offload_core.tiny import build_pipeline

from helpers import chaos_backend, exact_accounting, pipeline_reference

NAMES = [row.tiny_pipeline for row in ROWS if row.model_level]


@pytest.fixture(scope="module", params=NAMES)
def tiny(request):
    """A tiny pipeline and its output without offload."""
    tiny = build_pipeline(request.param)
    tiny.expected = pipeline_reference(tiny)
    return tiny


def _group_bytes(part):
    return [g.nbytes for g in part.groups]


def test_model_level_equals_no_offload(tiny):
    original_class = type(tiny.pipe)
    backend = chaos_backend()
    handle = offload_core.enable_offload(tiny.pipe, enable_cpu_offload=True, backend=backend)
    assert handle.strategy == "model"
    assert tiny.pipe._execution_device == backend.device() and tiny.pipe.device == backend.device()
    for _ in range(2):  # the second call runs with the learned order and overlapped prefetch
        assert torch.equal(tiny.run(seed=0), tiny.expected)
    part = handle.parts[0]
    stats = handle.stats()
    # overlap rule: at most the active group plus one prefetched group on the device
    two_largest = sum(sorted(_group_bytes(part))[-2:])
    assert part.device_weight_bytes <= two_largest
    if exact_accounting():
        assert stats["device_peak_bytes"] <= two_largest
    handle.disable()
    assert type(tiny.pipe) is original_class
    assert torch.equal(pipeline_reference(tiny), tiny.expected)


@pytest.mark.requires_capability(Capability.CAPACITY)
def test_model_level_within_a_device_that_fits_only_the_largest_group(tiny):
    """With no room beside the active group, nothing is prefetched: peak <= largest group."""
    probe = offload_core.enable_offload(tiny.pipe, enable_cpu_offload=True, backend=chaos_backend())
    largest = probe.parts[0].largest_group_bytes
    probe.disable()
    backend = chaos_backend(device_memory=largest)
    handle = offload_core.enable_offload(tiny.pipe, enable_cpu_offload=True, backend=backend)
    assert torch.equal(tiny.run(seed=0), tiny.expected)
    assert handle.stats()["device_peak_bytes"] <= largest
    handle.disable()


def test_layerwise_equals_no_offload(tiny):
    backend = chaos_backend()
    handle = offload_core.enable_offload(tiny.pipe, enable_layerwise_offload=True, backend=backend)
    assert handle.strategy == "layerwise"
    for _ in range(2):
        assert torch.equal(tiny.run(seed=0), tiny.expected)
    streamed = [p for p in handle.parts if hasattr(p, "units")  and hasattr(p, "num_slots")]
    dits = [n for n, _ in pipeline_modules(tiny.pipe) if component_kind(tiny.pipe, n) == "dit"]
    assert len(streamed) == len(dits) >= 1
    assert handle.stats()["prefetch_misses"] == 0
    handle.disable()
    assert torch.equal(pipeline_reference(tiny), tiny.expected)


def test_layerwise_streaming_every_component_group(tiny):
    backend = chaos_backend()
    handle = offload_core.enable_offload(
        tiny.pipe, enable_layerwise_offload=True, backend=backend, components=("dit", "text_encoder", "vae")
    )
    assert torch.equal(tiny.run(seed=0), tiny.expected)
    handle.disable()
    assert torch.equal(pipeline_reference(tiny), tiny.expected)
