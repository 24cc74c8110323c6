"""diffusers' own APIs on an offloaded pipeline (docs/design.md, contract rows 15 and 19): what
changes the pipeline (fused projections, VAE tiling, a dtype, a weight edited, a component
replaced) acts as without offload or is refused naming the fix, and diffusers' or accelerate's
own offloading is refused on either side of ``enable_offload``, the model left untouched."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.base.errors import OffloadedModelError
from offload_core.tiny import build_pipeline

from contract_models import ENABLE_OPTIONS
from helpers import assert_same_state, chaos_backend, snapshot
from stacks import StackSpec, build_stack


def _fuse_qkv(pipe):
    pipe.transformer.fuse_qkv_projections()


def _fuse_then_unfuse_qkv(pipe):
    pipe.transformer.fuse_qkv_projections()
    pipe.transformer.unfuse_qkv_projections()


def _vae_tiling(pipe):
    pipe.vae.enable_tiling()


def _pipeline_bfloat16(pipe):
    pipe.to(torch.bfloat16)


def _attention_block_weight_edit(pipe):
    with torch.no_grad():
        pipe.transformer.transformer_blocks[0].attn.to_q.weight.mul_(0.5)


PIPELINE_CASES = {
    "fuse_qkv_projections": _fuse_qkv,
    "fuse_then_unfuse_qkv_projections": _fuse_then_unfuse_qkv,
    "vae_enable_tiling": _vae_tiling,
    "pipeline_to_bfloat16": _pipeline_bfloat16,
    "attention_weight_edited": _attention_block_weight_edit,
}


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("case", PIPELINE_CASES)
def test_a_diffusers_api_on_an_offloaded_pipeline_acts_as_without_offload(strategy, case):
    from offload_core.tiny import build_pipeline

    ours, theirs = build_pipeline("flux2"), build_pipeline("flux2")
    handle = offload_core.enable_offload(ours.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    assert torch.equal(ours.run(), theirs.run())
    for tiny in (ours, theirs):
        PIPELINE_CASES[case](tiny.pipe)
    assert torch.equal(ours.run(seed=1), theirs.run(seed=1)), case
    handle.disable()
    assert torch.equal(ours.run(seed=2), theirs.run(seed=2))


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_component_replaced_after_enable_is_refused_at_the_next_call(strategy):
    ours, theirs = build_pipeline("flux2"), build_pipeline("flux2")
    handle = offload_core.enable_offload(ours.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    original = ours.pipe.transformer
    ours.pipe.transformer = build_pipeline("flux2", seed=1).pipe.transformer
    with pytest.raises(OffloadedModelError, match=r"transformer changed since enable_offload.*handle.disable\(\)"):
        ours.run()
    ours.pipe.transformer = original  # the model is usable again as it was
    assert torch.equal(ours.run(), theirs.run())
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("method", ["enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload"])
def test_diffusers_own_offloading_after_enable_is_refused(strategy, method):
    ours, theirs = build_pipeline("flux2"), build_pipeline("flux2")
    handle = offload_core.enable_offload(ours.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    with pytest.raises(offload_core.OffloadConfigError, match=rf"{method}\(\).*handle.disable\(\)"):
        getattr(ours.pipe, method)()
    assert torch.equal(ours.run(), theirs.run())
    handle.disable()
    assert type(ours.pipe).enable_model_cpu_offload is type(theirs.pipe).enable_model_cpu_offload


def test_a_model_offloaded_by_diffusers_is_refused_untouched():
    from diffusers.hooks import apply_group_offloading

    model = build_stack(StackSpec(d=8))
    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    before = snapshot(model)
    with pytest.raises(offload_core.OffloadConfigError, match="diffusers' group offloading"):
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    assert_same_state(before, snapshot(model))


def test_a_pipeline_offloaded_by_accelerate_is_refused(flux2):
    flux2.pipe.enable_model_cpu_offload(device="cpu")
    try:
        with pytest.raises(offload_core.OffloadConfigError, match="accelerate"):
            offload_core.enable_offload(flux2.pipe, enable_cpu_offload=True, backend=chaos_backend())
    finally:
        flux2.pipe.remove_all_hooks()
    assert torch.equal(flux2.run(seed=0), flux2.expected)


def _replace_data(pipe, component: str, scale: float) -> None:
    """``w.data = w.data * scale`` on a few weights of ``component``: new data, no version moved."""
    weights = [p for _, p in getattr(pipe, component).named_parameters()]
    for w in (weights[0], weights[len(weights) // 2], weights[-1]):
        w.data = w.data * scale


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("name", ["sd3", "wan2.2-t2v"])
def test_weight_data_replaced_between_calls_is_taken_in_for_every_component(strategy, name):
    """Each component given new data after a call (model-level prefetches a component during the
    call before its turn, from the host as it is then) computes with it in the next call, as
    without offload, and keeps it after disable()."""
    ours, theirs = build_pipeline(name), build_pipeline(name)
    handle = offload_core.enable_offload(ours.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    assert torch.equal(ours.run(), theirs.run())
    components = [n for n, m in ours.pipe.components.items() if isinstance(m, torch.nn.Module)]
    for seed, component in enumerate(components, start=1):
        for tiny in (ours, theirs):
            _replace_data(tiny.pipe, component, 1.5)
        assert torch.equal(ours.run(seed=seed), theirs.run(seed=seed)), f"{component} given new data"
    handle.disable()
    assert torch.equal(ours.run(seed=0), theirs.run(seed=0)), "after disable()"
