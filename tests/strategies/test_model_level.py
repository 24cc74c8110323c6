"""Model-level offload (one group per component, or the whole module, copied in for its call and
prefetched while the one before it computes): the tiny diffusers pipelines of the supported table
give the same images as no offload within the device budget, a bare module lives on the host
between calls, and weights changed while their group is home are what the next call copies."""

from __future__ import annotations

import copy

import pytest
import torch

import offload_core
from offload_core.testing import SimulatorCapability

from helpers import assert_same_state, chaos_backend, exact_accounting, pipeline_reference, snapshot
from stacks import StackSpec, build_stack


def test_in_place_changes_to_swapped_weights_are_kept(flux2):
    """A weight changed in place while its group is home (pinned host memory) is what the next
    swap-in copies to the device, and what the model holds after the group goes home again."""
    backend = chaos_backend()
    handle = offload_core.enable_offload(flux2.pipe, enable_cpu_offload=True, backend=backend)
    flux2.run(seed=0)
    encoder = flux2.pipe.text_encoder
    weight = next(encoder.parameters())
    tokens = torch.zeros(1, 4, dtype=torch.long)
    encoder(tokens)  # the encoder group runs, then goes home
    assert backend.is_pinned(weight.detach()), "the encoder group did not go home after its call"
    with torch.no_grad():
        weight.add_(1.0)
    expected = weight.detach().clone()
    reference = copy.deepcopy(encoder)  # a plain copy holding the changed weight
    with torch.no_grad():
        assert torch.equal(encoder(tokens)[0], reference(tokens)[0])  # the change went to the device
    assert backend.is_pinned(weight.detach())
    flux2.pipe.transformer.proj_out(torch.zeros(1, flux2.pipe.transformer.proj_out.in_features))  # swaps encoder out
    assert torch.equal(weight.detach(), expected)
    handle.disable()
    assert torch.equal(weight.detach(), expected)
    with torch.no_grad():
        weight.sub_(1.0)


def test_model_level_on_a_bare_module_lives_on_the_host_between_calls():
    """A module with weights of its own (as many DiTs have) is one group: copied in for each call,
    dropped when its forward returns."""
    model = build_stack(StackSpec(d=8, layer_dtypes=[[torch.float32, torch.bfloat16]] * 4, seed=2))
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    before = snapshot(model)
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, enable_cpu_offload=True, backend=backend)
    for _ in range(2):
        with torch.no_grad():
            assert torch.equal(model(x), expected)
        assert backend.memory_allocated() == 0, "the weights stayed on the device after the call"
    stats = handle.stats()
    assert stats["device_peak_bytes"] == stats["host_bytes"]
    assert stats["h2d_copies"] == 2 * 2  # two calls, one copy per dtype each
    handle.disable()
    assert_same_state(before, snapshot(model))


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
