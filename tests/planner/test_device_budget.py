"""A device budget (docs/planner.md): ``enable_offload(pipe, device_memory=...)`` on the fake
with its device capacity set to the budget, on five pipelines of the supported table, at budgets
from 10% to 100% of the weights. Below the smallest budget that works, enable refuses before
anything moves and names that budget; from it up, nothing runs out of memory, the device peak
stays within the budget, outputs equal the pipeline's without offload, each streamed component
copies exactly the bytes the plan predicts, fewer as the budget grows, and none once everything
fits."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.planning.fitting import pipeline_plan_inputs
from offload_core.discovery.pipelines import pipeline_modules
from offload_core.planning import make_plan
from offload_core.tiny import build_pipeline

from helpers import chaos_backend, pipeline_reference
from plan_copies import copied_as_planned, streamed_copies

pytestmark = pytest.mark.fake_only("the fake's device capacity is set to the budget")

PIPELINES = ["flux2-deep", "qwen-image", "sd3", "wan2.2-t2v", "sdxl"]
FRACTIONS = [0.1, 0.25, 0.5, 0.75, 1.0]
ACTIVATION = 16 * 2**10  # given: the fake counts the weights' device memory, not activations


def components(pipe):
    return pipeline_plan_inputs(pipe, pipeline_modules(pipe)).components


def smallest_budget(pipe) -> int:
    """The smallest budget layerwise offload of ``pipe`` works in, each phase given the device."""
    inputs = pipeline_plan_inputs(pipe, pipeline_modules(pipe), cls_name=type(pipe).__name__)
    planned = [c.with_measurements(activation_bytes=ACTIVATION) for c in inputs.components]
    return make_plan(planned, 2**40, strategy="layerwise", phases=inputs.phases, steps=inputs.steps).min_budget


@pytest.mark.parametrize("name", PIPELINES)
def test_layerwise_sized_by_the_budget(name):
    tiny = build_pipeline(name)
    reference = pipeline_reference(tiny)
    weights = sum(c.total_bytes for c in components(tiny.pipe))
    floor = smallest_budget(tiny.pipe)
    copied_per_call = []
    for fraction in FRACTIONS:
        budget = int(fraction * weights) + ACTIVATION
        options = dict(enable_layerwise_offload=True, device_memory=budget, activation_memory=ACTIVATION,
                       backend=chaos_backend(device_memory=budget))
        if budget < floor:
            before = [p.data_ptr() for p in tiny.pipe.transformer.parameters()] if hasattr(tiny.pipe, "transformer") \
                else None
            with pytest.raises(offload_core.OffloadConfigError, match="smallest budget that works"):
                offload_core.enable_offload(tiny.pipe, **options)
            assert not hasattr(tiny.pipe, "_offload_core_handle"), "a refused budget leaves the pipeline as it was"
            if before is not None:
                assert [p.data_ptr() for p in tiny.pipe.transformer.parameters()] == before
            continue
        handle = offload_core.enable_offload(tiny.pipe, **options)
        start, plan = streamed_copies(handle), handle.plan
        assert torch.equal(tiny.run(), reference), f"{name} at {fraction:.0%} of the weights"
        stats = handle.stats()
        assert stats["prefetch_misses"] == 0
        assert stats["device_peak_bytes"] <= budget
        copied_per_call.append(copied_as_planned(handle, start, plan))
        handle.disable()
    assert copied_per_call == sorted(copied_per_call, reverse=True), copied_per_call
    assert copied_per_call[-1] == 0, "everything fits at 100%: nothing streams"


def test_the_first_call_measures_activations_and_the_plan_shows_them():
    """A block whose forward takes 64 KiB of device memory beyond the weights (allocated through
    the backend, which the fake counts) is measured on the first call; with 1 KiB reserved the
    plan says the budget may be exceeded."""
    tiny = build_pipeline("flux2-deep")
    weights = sum(c.total_bytes for c in components(tiny.pipe))
    backend = chaos_backend()
    handle = offload_core.enable_offload(tiny.pipe, enable_layerwise_offload=True, device_memory=weights // 2,
                                         activation_memory=1024, backend=backend)
    assert handle.plan.component("transformer").activation_source == "given"
    taken = 64 * 2**10
    block = tiny.pipe.transformer.transformer_blocks[3]

    def take(*args) -> None:
        backend.empty_device(taken).fill_(0)

    block.register_forward_hook(take)
    tiny.run()
    planned = handle.plan.component("transformer")
    assert planned.activation_source == "measured" and planned.activation_bytes >= taken
    assert any("transformer took" in note and "activation_memory=" in note for note in handle.plan.notes)
    assert "measured" in str(handle.plan)
    handle.disable()


def test_from_pretrained_plans_the_checkpoint_as_it_will_be_packed(tmp_path):
    """Weights read straight from the checkpoint are planned by the packer's own layout (the
    blocks are still on the meta device when the plan is made): the copies are the plan's."""
    import diffusers

    from offload_core.tiny import TinyPipeline

    tiny = build_pipeline("flux2-deep")
    tiny.pipe.save_pretrained(tmp_path)
    reference = diffusers.Flux2Pipeline.from_pretrained(tmp_path, dtype=torch.bfloat16)
    reference.set_progress_bar_config(disable=True)
    expected = TinyPipeline("ref", reference, tiny.call_kwargs, tiny.output_attr).run(seed=0)
    budget = (smallest_budget(reference) + sum(c.total_bytes for c in components(reference))) // 2
    handle = offload_core.from_pretrained(tmp_path, torch_dtype=torch.bfloat16, enable_layerwise_offload=True,
                                          device_memory=budget, activation_memory=ACTIVATION,
                                          backend=chaos_backend(device_memory=budget))
    pipe = handle.target
    pipe.set_progress_bar_config(disable=True)
    streamed = [p for p in handle.parts if hasattr(p, "kept_names")]
    assert streamed and any(p.kept for p in streamed), "the budget keeps some blocks"
    start, plan = streamed_copies(handle), handle.plan
    assert torch.equal(TinyPipeline("offloaded", pipe, tiny.call_kwargs, tiny.output_attr).run(seed=0), expected)
    assert handle.stats()["device_peak_bytes"] <= budget
    for part in streamed:
        planned = plan.component(part.label)
        assert planned.resident_blocks == tuple(part.all_names.index(n) for n in part.kept_names)
    copied_as_planned(handle, start, plan)
    handle.disable()


def test_blocks_name_the_dits_lists_when_the_plan_streams_an_encoder_too():
    from offload_core.discovery import declared_attrs

    tiny = build_pipeline("flux2-deep")
    reference = pipeline_reference(tiny)
    attrs = list(declared_attrs(tiny.pipe.transformer))
    budget = 2 * 2**20
    handle = offload_core.enable_offload(tiny.pipe, device_memory=budget, blocks=attrs, resident_blocks=0,
                                         enable_layerwise_offload=True, backend=chaos_backend(device_memory=budget))
    assert {c.name for c in handle.plan.components if c.mode == "streamed"} >= {"transformer", "text_encoder"}
    assert torch.equal(tiny.run(), reference)
    handle.disable()


def test_model_level_chosen_by_the_budget_prefetches_only_within_it():
    """On a device larger than the budget, model-level's prefetch of the next group (from the
    second call, once the active group's activations are known) must still fit the budget."""
    tiny = build_pipeline("flux2")
    reference = pipeline_reference(tiny)
    budget = int(0.6 * sum(c.total_bytes for c in components(tiny.pipe)))
    handle = offload_core.enable_offload(tiny.pipe, device_memory=budget, activation_memory=2**12,
                                         backend=chaos_backend())  # no capacity: the device is larger
    assert handle.strategy == "model" and handle.plan.chosen_by == "budget"
    for _ in range(2):
        assert torch.equal(tiny.run(), reference)
    assert handle.stats()["device_peak_bytes"] <= budget
    handle.disable()
