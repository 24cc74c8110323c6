"""Contract point 3 (docs/design.md): LoRA through diffusers and peft on an offloaded pipeline
(a tiny FLUX.2, LoRA state dicts made in code) gives exactly the output of the same LoRA on the
same pipeline without offload, for model-level and layerwise offload, at every step: an adapter
loaded before enable, one loaded after, set_adapters with weights, fuse_lora, unfuse_lora,
unload_lora_weights, disable. The adapter weights are offloaded like the base weights."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.tiny import build_pipeline

from contract_models import ENABLE_OPTIONS, lora_state_dict, offloaded_ids
from helpers import chaos_backend

pytest.importorskip("peft")


def lora_parameters(module) -> dict:
    return {name: p for name, p in module.named_parameters() if "lora_" in name}


def assert_offloaded(handle, params: dict) -> None:
    owned = offloaded_ids(handle)
    assert params and all(id(p) in owned for p in params.values()), "adapter weights not offloaded"


@pytest.mark.filterwarnings("ignore:Already found a `peft_config`")  # peft's note on a second adapter
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_lora_on_an_offloaded_pipeline_equals_lora_without_offload(strategy):
    ours, theirs = build_pipeline("flux2"), build_pipeline("flux2")
    transformer = theirs.pipe.transformer
    for tiny in (ours, theirs):
        tiny.pipe.load_lora_weights(lora_state_dict(transformer, 1), adapter_name="first")
    handle = offload_core.enable_offload(ours.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])

    steps = [
        ("adapter loaded before enable", lambda pipe: None),
        ("adapter loaded after enable",
         lambda pipe: pipe.load_lora_weights(lora_state_dict(transformer, 2), adapter_name="second")),
        ("set_adapters with weights", lambda pipe: pipe.set_adapters(["first", "second"], adapter_weights=[0.7, 0.4])),
        ("fuse_lora", lambda pipe: pipe.fuse_lora(lora_scale=0.8)),
        ("unfuse_lora", lambda pipe: pipe.unfuse_lora()),
        ("unload_lora_weights", lambda pipe: pipe.unload_lora_weights()),
    ]
    for label, step in steps:
        step(ours.pipe)
        step(theirs.pipe)
        assert torch.equal(ours.run(seed=0), theirs.run(seed=0)), label
        if strategy == "model":
            assert handle.backend.memory_allocated() == 0, "model-level holds no weights between calls"
        if label == "adapter loaded after enable":
            assert_offloaded(handle, lora_parameters(ours.pipe.transformer))
    handle.disable()
    expected = dict(theirs.pipe.transformer.named_parameters())
    for name, p in ours.pipe.transformer.named_parameters():
        assert torch.equal(p, expected[name]), name
    assert torch.equal(ours.run(seed=0), theirs.run(seed=0))
