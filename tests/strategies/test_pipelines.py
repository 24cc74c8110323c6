"""End to end on tiny real diffusers pipelines: layerwise offload gives the same images as no
offload (same seed, 2 steps), within the device budget, and disable restores (model-level offload
of the same pipelines: test_model_level.py)."""

from __future__ import annotations

import torch

import offload_core
from offload_core.discovery.pipelines import component_kind, pipeline_modules

from helpers import chaos_backend, exact_accounting, pipeline_reference


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
