"""End to end on tiny real diffusers pipelines: model-level and layerwise offload give the same
images as no offload (same seed, 2 steps), within the device budget, and disable restores."""

from __future__ import annotations


import pytest
import torch

import offload_core
from offload_core.pipelines import component_kind, pipeline_modules
from offload_core.testing import SimulatorCapability
from offload_core.tiny import build_pipeline

from tools.supported_models import ROWS
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
    assert torch.equal(tiny.run(seed=0), tiny.expected)
    with handle.trace() as timeline:  # the second call runs with the learned order
        assert torch.equal(tiny.run(seed=0), tiny.expected)
        if exact_accounting():  # on a device, the library's workspaces count too
            assert backend.memory_allocated() == 0, "components stayed on the device after the pipeline call"
    part = handle.parts[0]
    stats = handle.stats()
    # overlap rule: at most the active group plus one prefetched group on the device
    two_largest = sum(sorted(_group_bytes(part))[-2:])
    assert part.device_weight_bytes <= two_largest
    if exact_accounting():
        assert stats["device_peak_bytes"] <= two_largest
    # overlapped prefetch: each group after the first was copied while the one before it computed
    spans = timeline.spans()
    active = [s for s in spans if s.kind == "compute"]
    loads = [s for s in spans if s.kind == "copy"]
    assert {s.name for s in active} == {g.name for g in part.groups} and len(active) >= 2
    for earlier, before, after in zip([None, *active], active, active[1:]):
        since = earlier.end_ns if earlier is not None else -1
        assert any(
            load.name == f"load {after.name}" and since < load.start_ns < before.end_ns for load in loads
        ), f"{after.name} was not copied while {before.name} computed"
    handle.disable()
    assert type(tiny.pipe) is original_class
    assert torch.equal(pipeline_reference(tiny), tiny.expected)


@pytest.mark.requires_capability(SimulatorCapability.CAPACITY)
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
    """components= decides what streams: encoders block by block, the VAE staged around its use
    and dropped at the end of the call; the timeline shows each of them loaded and run."""
    backend = chaos_backend()
    handle = offload_core.enable_offload(
        tiny.pipe, enable_layerwise_offload=True, backend=backend, components=("dit", "text_encoder", "vae")
    )
    with handle.trace() as timeline:
        assert torch.equal(tiny.run(seed=0), tiny.expected)
    kinds = {name: component_kind(tiny.pipe, name) for name, _ in pipeline_modules(tiny.pipe)}
    spans = timeline.spans()
    computed = {s.name for s in spans if s.kind == "compute"}
    loaded = {s.name for s in spans if s.kind == "copy"}
    for name, kind in kinds.items():
        if kind in ("dit", "text_encoder"):  # streamed block by block (two-block stacks stay in their slots)
            assert any(n.startswith(f"{name}.") for n in computed), f"{name}'s blocks did not stream"
        elif kind == "vae":  # staged: copied in for the decode
            assert name in computed and f"load {name}" in loaded
    vae_bytes = sum(p.host_bytes for p in handle.parts if not hasattr(p, "num_slots"))
    if exact_accounting():  # on a device, the library's workspaces count too
        assert backend.memory_allocated() <= handle.device_weight_bytes - vae_bytes  # the VAE left the device
    handle.disable()
    assert torch.equal(pipeline_reference(tiny), tiny.expected)
