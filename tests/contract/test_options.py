"""Every invalid option is an OffloadConfigError that names it, raised before anything changes:
wrong types and values, unknown names (options, backends, backend options), options that do not
apply to the target or strategy, and environment variables that do not parse. And how the options
that are valid combine: which strategy flag wins, and how the backend is chosen (the argument, the
environment variable, auto-detection)."""

from __future__ import annotations

import dataclasses
import logging
import warnings

import pytest
import torch

import offload_core
from offload_core import OffloadConfig, OffloadConfigError
from offload_core.common.config import count, option
from offload_core_fake import FakeBackend

from helpers import assert_same_state, chaos_backend, snapshot
from stacks import StackSpec, build_stack

LAYERWISE = {"enable_layerwise_offload": True}
MODEL = {"enable_cpu_offload": True}


@pytest.fixture
def model():
    return build_stack(StackSpec(d=8, seed=1))


@pytest.mark.parametrize(
    "options, named",
    [
        ({**LAYERWISE, "pin_memory": "no"}, "pin_memory='no'"),
        ({**LAYERWISE, "pin_memory": 0}, "pin_memory=0"),
        ({"enable_distributed_layerwise_offload": True, "shard_host_weights": "maybe"}, "shard_host_weights='maybe'"),
        ({"enable_layerwise_offload": "yes"}, "enable_layerwise_offload='yes'"),
        ({**LAYERWISE, "prefetch_depth": 0}, "prefetch_depth=0"),
        ({**LAYERWISE, "prefetch_depth": 1.5}, "prefetch_depth=1.5"),
        ({**LAYERWISE, "prefetch_depth": True}, "prefetch_depth=True"),
        ({**LAYERWISE, "prefetch_depth": "2"}, "prefetch_depth='2'"),
        ({**LAYERWISE, "blocks": ""}, "blocks=''"),
        ({**LAYERWISE, "blocks": ["layers", None]}, "blocks=['layers', None]"),
        ({**LAYERWISE, "blocks": 5}, "blocks=5"),
        ({**LAYERWISE, "backend": 3}, "backend=3"),
        ({"enable_distributed_layerwise_offload": True, "process_group": "world"}, "process_group='world'"),
        ({**LAYERWISE, "prefetch": 2}, "unknown option(s) prefetch; valid options: "),
    ],
)
def test_bad_values_name_the_option_and_change_nothing(model, options, named):
    before = snapshot(model)
    with pytest.raises(OffloadConfigError) as caught:
        offload_core.enable_offload(model, **{"backend": chaos_backend(), **options})
    assert named in str(caught.value)
    assert_same_state(before, snapshot(model))
    assert not any(m._forward_pre_hooks or "forward" in m.__dict__ for m in model.modules())


def test_config_objects_are_checked_too():
    with pytest.raises(OffloadConfigError, match=r"invalid components=\('dit', 'unet'\): unknown 'unet'"):
        OffloadConfig(enable_layerwise_offload=True, components=("dit", "unet"))
    with pytest.raises(OffloadConfigError, match="config must be an offload_core.OffloadConfig, got dict"):
        offload_core.enable_offload(build_stack(StackSpec()), config={"enable_layerwise_offload": True})


def test_an_unknown_backend_name_is_a_config_error_listing_the_registered_ones(model):
    with pytest.raises(OffloadConfigError, match=r"unknown offload backend 'nope'; registered backends: .*fake") as caught:
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend="nope")
    assert isinstance(caught.value, offload_core.BackendNotFoundError) and isinstance(caught.value, LookupError)


@pytest.mark.parametrize("target", [None, "pipe", torch.zeros(3)])
def test_a_target_that_is_neither_a_pipeline_nor_a_module(target):
    with pytest.raises(OffloadConfigError, match="target must be a diffusers pipeline or a torch.nn.Module, got"):
        offload_core.enable_offload(target, enable_layerwise_offload=True, backend=chaos_backend())


@pytest.mark.parametrize(
    "options, message",
    [
        ({**LAYERWISE, "components": ["dit"]}, "components= applies to a diffusers pipeline, not to a bare torch.nn.Module"),
        ({**MODEL, "blocks": ["layers"]}, "blocks= applies to layerwise or distributed layerwise offload, not to model-level"),
        ({**MODEL, "prefetch_depth": 2}, "prefetch_depth= applies to layerwise offload, not to model-level"),
        ({**LAYERWISE, "shard_host_weights": False}, "shard_host_weights= applies to distributed layerwise offload"),
    ],
)
def test_options_that_do_not_apply_are_errors(model, options, message):
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=message):
        offload_core.enable_offload(model, backend=chaos_backend(), **options)
    assert_same_state(before, snapshot(model))


def test_an_option_only_a_losing_flag_would_use_is_warned_about_once(model):
    """Layerwise wins over model-level: an option both strategies ignore would be an error, but
    prefetch_depth is layerwise's own; here distributed wins over layerwise and ignores it."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="initialised torch.distributed process group"):
            offload_core.enable_offload(
                model, enable_distributed_layerwise_offload=True, enable_layerwise_offload=True, prefetch_depth=3,
                backend=chaos_backend(),
            )
    messages = [str(w.message) for w in caught]
    assert sum("prefetch_depth= ignored" in m for m in messages) == 1, messages
    assert any("ignoring enable_layerwise_offload" in m for m in messages)


def test_defaults_given_explicitly_are_not_misuse(model):
    """prefetch_depth=1 and shard_host_weights=True are the defaults: given to model-level offload,
    which uses neither, they are neither an error nor a warning, and the model runs offloaded."""
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = offload_core.enable_offload(model, enable_cpu_offload=True, prefetch_depth=1, shard_host_weights=True,
                                             backend=chaos_backend())
    assert handle.strategy == "model"
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    handle.disable()


@pytest.mark.parametrize(
    "variable, value",
    [
        ("OFFLOAD_CORE_FAKE_DEVICE_MEMORY", "abc"),
        ("OFFLOAD_CORE_FAKE_DEVICE_MEMORY", "-5"),
        ("OFFLOAD_CORE_FAKE_PINNED_MEMORY", "1.5"),
        ("OFFLOAD_CORE_FAKE_H2D_BANDWIDTH", "fast"),
        ("OFFLOAD_CORE_FAKE_H2D_BANDWIDTH", "0"),
        ("OFFLOAD_CORE_FAKE_CHAOS", "maybe"),
    ],
)
def test_environment_variables_that_do_not_parse_name_the_variable(monkeypatch, variable, value):
    monkeypatch.setenv(variable, value)
    with pytest.raises(OffloadConfigError, match=f"invalid environment variable {variable}={value!r}"):
        FakeBackend()


@pytest.mark.parametrize(
    "word, expected", [("1", True), ("on", True), ("Yes", True), ("true", True), ("0", False), ("off", False)]
)
def test_chaos_reads_the_same_from_the_keyword_and_the_environment(monkeypatch, word, expected):
    keyword = FakeBackend(chaos=word)
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_CHAOS", word)
    from_env = FakeBackend()
    try:
        assert keyword.chaos is from_env.chaos is expected
    finally:
        keyword.close()
        from_env.close()


def test_chaos_maybe_is_refused_by_keyword_as_by_environment():
    with pytest.raises(OffloadConfigError, match="invalid chaos='maybe'"):
        FakeBackend(chaos="maybe")
    with pytest.raises(OffloadConfigError, match="invalid device_memory=-1"):
        FakeBackend(device_memory=-1)
    with pytest.raises(OffloadConfigError, match="invalid chaos_delay='1ms'"):
        FakeBackend(chaos_delay="1ms")


def test_unknown_backend_options_are_named_with_the_valid_ones():
    with pytest.raises(OffloadConfigError, match=r"backend 'fake' has no option 'chaoss'; its options: chaos, "):
        offload_core.get_backend("fake", chaoss=True)


@dataclasses.dataclass
class _WithBudget(OffloadConfig):
    """How another option joins: one field, its parser, where it applies."""

    budget: int | None = option(None, lambda v: None if v is None else count(1)(v), strategies=("layerwise",))


def test_a_new_option_is_one_field_checked_like_the_others():
    with pytest.raises(OffloadConfigError, match="invalid budget='lots'"):
        _WithBudget(enable_layerwise_offload=True, budget="lots")
    with pytest.raises(OffloadConfigError, match="budget= applies to layerwise offload, not to model-level"):
        _WithBudget(enable_cpu_offload=True, budget=5).check_applies("module")
    _WithBudget(enable_layerwise_offload=True, budget=5).check_applies("module")


def test_from_pretrained_takes_enable_offloads_options_from_its_signature():
    """One list of options: from_pretrained's signature (what help() shows, what a call binds
    to) has enable_offload's, with their defaults and annotations, between its own parameters."""
    import inspect

    from offload_core.pretrained.load import from_pretrained

    options = [p for p in inspect.signature(offload_core.enable_offload).parameters.values()
               if p.kind is p.KEYWORD_ONLY]
    assert [p.name for p in options] == [f.name for f in dataclasses.fields(OffloadConfig)]
    params = list(inspect.signature(from_pretrained).parameters.values())
    assert [p.name for p in params[:2]] == ["path", "torch_dtype"] and params[-1].kind is params[-1].VAR_KEYWORD
    assert params[2:-1] == options


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


def test_components_apply_to_layerwise_only(flux2):
    with pytest.raises(offload_core.OffloadConfigError, match="components= applies to layerwise"):
        offload_core.enable_offload(flux2.pipe, enable_cpu_offload=True, components=["vae"], backend=chaos_backend())
    assert not hasattr(flux2.pipe, "_offload_core_handle")
