"""Flag priority, option validation, auto-detection, and model-level on a bare module."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

import offload_core
from offload_core.tiny import build_pipeline

from helpers import assert_same_state, chaos_backend, snapshot
from stacks import StackSpec, build_stack


@pytest.fixture(scope="module")
def flux2():
    tiny = build_pipeline("flux2")
    tiny.expected = tiny.run(seed=0)
    return tiny


def test_layerwise_wins_over_model_level_with_a_warning_naming_the_ignored_flag(flux2):
    with pytest.warns(UserWarning, match="enable_layerwise_offload wins; ignoring enable_cpu_offload"):
        handle = offload_core.enable_offload(
            flux2.pipe, enable_cpu_offload=True, enable_layerwise_offload=True, backend=chaos_backend()
        )
    assert handle.strategy == "layerwise"
    handle.disable()


def test_config_object_priority_and_ignored_flags():
    config = offload_core.OffloadConfig(
        enable_cpu_offload=True, enable_layerwise_offload=True, enable_distributed_layerwise_offload=True
    )
    assert config.strategy == "distributed"
    assert config.ignored_flags() == ["enable_layerwise_offload", "enable_cpu_offload"]
    assert offload_core.OffloadConfig(enable_cpu_offload=True).strategy == "model"
    assert offload_core.OffloadConfig().strategy is None


@pytest.mark.parametrize(
    "options,message",
    [
        ({"enable_layerwise_offload": True, "prefetch_depth": 0}, "invalid prefetch_depth=0: must be >= 1"),
        ({"enable_layerwise_offload": True, "components": ("dit", "unet")}, r"invalid components=.*unknown 'unet'"),
        ({"enable_layerwise_offload": "yes"}, "invalid enable_layerwise_offload='yes': expected True or False"),
        ({"enable_layerwise_offload": True, "prefetch": 2}, "unknown option.*prefetch; valid options"),
        ({}, "no strategy selected"),
    ],
)
def test_bad_options_are_clear_errors_and_leave_the_pipeline_untouched(flux2, options, message):
    before = snapshot(flux2.pipe.transformer)
    original = type(flux2.pipe)
    with pytest.raises(offload_core.OffloadConfigError, match=message):
        offload_core.enable_offload(flux2.pipe, backend=chaos_backend(), **options)
    assert type(flux2.pipe) is original
    assert_same_state(before, snapshot(flux2.pipe.transformer))


def test_failure_in_a_later_component_rolls_back_the_earlier_ones(flux2):
    """Packing succeeds for the DiT, then the device runs out for the resident encoder: all undone."""
    before = {n: snapshot(m) for n, m in flux2.pipe.components.items() if isinstance(m, nn.Module)}
    probe = offload_core.enable_offload(flux2.pipe, enable_layerwise_offload=True, backend=chaos_backend())
    streamed = probe.parts[0].device_weight_bytes
    probe.disable()
    backend = chaos_backend(device_memory=streamed + 16)
    with pytest.raises(torch.OutOfMemoryError):
        offload_core.enable_offload(flux2.pipe, enable_layerwise_offload=True, backend=backend)
    for name, state in before.items():
        assert_same_state(state, snapshot(flux2.pipe.components[name]))
    assert backend.memory_allocated() == 0
    assert torch.equal(flux2.run(seed=0), flux2.expected)


def test_auto_detection_falls_back_to_fake_with_a_logged_warning(flux2, caplog, monkeypatch):
    monkeypatch.delenv("OFFLOAD_CORE_BACKEND", raising=False)
    with caplog.at_level(logging.WARNING, logger="offload_core"):
        handle = offload_core.enable_offload(flux2.pipe, enable_cpu_offload=True)
    assert handle.backend.name == "fake"
    assert "no accelerator" in caplog.text
    assert torch.equal(flux2.run(seed=0), flux2.expected)
    handle.disable()


def test_environment_variable_selects_the_backend(flux2, monkeypatch):
    monkeypatch.setenv("OFFLOAD_CORE_BACKEND", "fake")
    handle = offload_core.enable_offload(flux2.pipe, enable_cpu_offload=True)
    assert handle.backend is offload_core.get_backend("fake")
    handle.disable()
    monkeypatch.setenv("OFFLOAD_CORE_BACKEND", "no-such-backend")
    with pytest.raises(offload_core.BackendNotFoundError, match="registered backends: .*fake"):
        offload_core.enable_offload(flux2.pipe, enable_cpu_offload=True)


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


def test_components_apply_to_layerwise_only(flux2):
    with pytest.raises(offload_core.OffloadConfigError, match="components= applies to layerwise"):
        offload_core.enable_offload(flux2.pipe, enable_cpu_offload=True, components=["vae"], backend=chaos_backend())
    assert not hasattr(flux2.pipe, "_offload_core_handle")
