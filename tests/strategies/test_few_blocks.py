"""Layerwise offload never refuses over the number of blocks: one block streams through one slot,
zero blocks keep a model resident, and a pipeline component whose stack cannot be found is staged
like the VAE. Text encoders from transformers are streamed by rule (the layer stack beside their
input embeddings), whatever wrapper holds it."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import offload_core
from offload_core.discovery import find_blocks
from offload_core.strategies.layerwise import LayerwiseOffload
from offload_core.strategies.model_level import ModelLevelOffload
from offload_core.strategies.resident import ResidentModules
from offload_core.tiny import build_pipeline
from offload_core.tiny import encoders as enc
from offload_core.tiny import tokenizers as tok

from helpers import assert_same_state, chaos_backend, free_port, snapshot
from stacks import StackSpec, build_stack

X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def run(model, x=X):
    with torch.no_grad():
        return model(x)


def offload_records(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("offload_core") and r.levelno >= logging.INFO]


# -- one block ---------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 3])
def test_one_block_streams_through_one_slot(caplog, depth):
    model = build_stack(StackSpec(layer_dtypes=[[torch.float32, torch.bfloat16, torch.float32]], transposed=True))
    before = snapshot(model)
    expected = [run(model, X + i) for i in range(3)]
    caplog.set_level(logging.INFO, logger="offload_core")
    handle = offload_core.enable_offload(
        model, enable_layerwise_offload=True, backend=chaos_backend(), prefetch_depth=depth
    )
    part = handle.parts[0]
    assert isinstance(part, LayerwiseOffload) and len(part.units) == 1 and part.num_slots == 1
    assert any("one block in one slot: its copy cannot overlap compute" in m for m in offload_records(caplog))
    copies = handle.stats()["h2d_copies"]
    for i in range(3):
        assert torch.equal(run(model, X + i), expected[i])
    stats = handle.stats()
    assert stats["prefetch_misses"] == 0
    # loaded afresh at every forward, one copy per dtype (the host may have changed in between)
    assert stats["h2d_copies"] == copies + 3 * len(part.units[0].numel)
    assert stats["device_peak_bytes"] == part.resident_bytes + part.slot_bytes
    handle.disable()
    assert_same_state(before, snapshot(model))


def test_one_block_dit_in_a_pipeline_streams():
    """The supported FLUX.2 pipeline with its DiT declared as one block (its last single block)."""
    tiny = build_pipeline("flux2")
    expected = tiny.run(seed=0)
    offload_core.register_blocks("Flux2Transformer2DModel", ["single_transformer_blocks.2"])
    try:
        handle = offload_core.enable_offload(tiny.pipe, enable_layerwise_offload=True, backend=chaos_backend())
        part = handle.parts[0]
        assert part.model is tiny.pipe.transformer and len(part.units) == 1 and part.num_slots == 1
        for _ in range(2):
            assert torch.equal(tiny.run(seed=0), expected)
        handle.disable()
    finally:
        offload_core.register_blocks("Flux2Transformer2DModel", ["transformer_blocks", "single_transformer_blocks"])
    assert torch.equal(tiny.run(seed=0), expected)


def test_a_one_entry_stack_is_not_mistaken_for_the_lists_inside_its_block():
    model = build_stack(StackSpec(layer_dtypes=[[torch.float32, torch.float32]]))
    assert find_blocks(model) == [("blocks.0", model.blocks[0])]


def _one_block_worker(rank: int, port: int) -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    torch.set_num_threads(1)
    from helpers import assert_same_state, snapshot
    from stacks import StackSpec, build_stack

    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    backend.init_process_group(rank, 2, f"tcp://127.0.0.1:{port}")
    model = build_stack(StackSpec(layer_dtypes=[[torch.float32, torch.bfloat16]], seed=5))
    expected = [run(model, X + i) for i in range(2)]
    before = snapshot(model)
    handle = offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend)
    assert handle.describe()[0]["slots"] == 1
    for i in range(2):
        assert torch.equal(run(model, X + i), expected[i]), f"rank {rank}"
    handle.disable()  # collective: reloads the one block into its slot to rebuild the host weights
    assert_same_state(before, snapshot(model))


def test_one_block_distributed_with_sharded_host_weights():
    mp.spawn(_one_block_worker, args=(free_port(),), nprocs=2, join=True)


# -- zero blocks -------------------------------------------------------------------------------


class NoStack(nn.Module):
    """A model without any module list: nothing to stream."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x):
        return self.body(x)


class EmptyStack(NoStack):
    """A declared block list that is empty (a configuration with zero layers)."""

    offload_core_blocks = ("blocks",)

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList()


@pytest.mark.parametrize("cls", [NoStack, EmptyStack])
def test_zero_blocks_keep_the_model_resident_with_one_logged_line(caplog, cls):
    torch.manual_seed(0)
    model = cls().eval()
    before = snapshot(model)
    expected = run(model)
    backend = chaos_backend()
    caplog.set_level(logging.INFO, logger="offload_core")
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    lines = [m for m in offload_records(caplog) if "no blocks to stream" in m]
    assert len(lines) == 1 and cls.__name__ in lines[0] and "stays resident" in lines[0]
    assert f"register_blocks({cls.__name__!r}" in lines[0]
    assert handle.strategy == "layerwise" and [type(p) for p in handle.parts] == [ResidentModules]
    assert all(p.device == backend.device() for p in model.parameters())
    assert torch.equal(run(model), expected)
    handle.disable()
    assert_same_state(before, snapshot(model))


# -- components without a stack: staged like the VAE -------------------------------------------


def _staged(handle) -> set[int]:
    return {id(c.module) for p in handle.parts if isinstance(p, ModelLevelOffload) for g in p.groups for c in g.components}


def _streamed(handle) -> set[int]:
    return {id(p.model) for p in handle.parts if isinstance(p, LayerwiseOffload)}


@pytest.mark.parametrize("declared", ["missing", "none"], ids=["declared-missing", "declared-none"])
def test_text_encoder_without_a_stack_is_staged_with_one_logged_line(flux2, monkeypatch, caplog, declared):
    encoder = flux2.pipe.text_encoder
    if declared == "none":
        monkeypatch.setattr(encoder, "optional_layers", None, raising=False)
        monkeypatch.setattr(type(encoder), "offload_core_blocks", ("optional_layers",), raising=False)
    else:
        monkeypatch.setattr(type(encoder), "offload_core_blocks", ("model.no_such_layers",), raising=False)
    caplog.set_level(logging.INFO, logger="offload_core")
    handle = offload_core.enable_offload(
        flux2.pipe, enable_layerwise_offload=True, backend=chaos_backend(), components=("dit", "text_encoder", "vae")
    )
    lines = [m for m in offload_records(caplog) if "staged onto the device" in m]
    assert len(lines) == 1 and lines[0].startswith("layerwise offload: text_encoder (Mistral3ForConditionalGeneration)")
    assert "register_blocks('Mistral3ForConditionalGeneration'" in lines[0]
    assert id(encoder) in _staged(handle) and id(flux2.pipe.transformer) in _streamed(handle)
    for _ in range(2):
        assert torch.equal(flux2.run(seed=0), flux2.expected)
        staged = next(p for p in handle.parts if isinstance(p, ModelLevelOffload))
        assert all(g.state == "host" for g in staged.groups), "staged components are dropped when the call ends"
    handle.disable()
    assert torch.equal(flux2.run(seed=0), flux2.expected)


def test_dit_without_a_stack_is_staged_not_refused(flux2, monkeypatch):
    monkeypatch.setattr(type(flux2.pipe.transformer), "offload_core_blocks", ("no_blocks_here",), raising=False)
    handle = offload_core.enable_offload(flux2.pipe, enable_layerwise_offload=True, backend=chaos_backend())
    assert id(flux2.pipe.transformer) in _staged(handle) and not _streamed(handle)
    assert torch.equal(flux2.run(seed=0), flux2.expected)
    handle.disable()


def test_explicit_block_names_that_do_not_exist_are_still_an_error(flux2):
    before = snapshot(flux2.pipe.transformer)
    with pytest.raises(offload_core.BlockDiscoveryError, match="nope"):
        offload_core.enable_offload(flux2.pipe, enable_layerwise_offload=True, backend=chaos_backend(), blocks=["nope"])
    assert not hasattr(flux2.pipe, "_offload_core_handle")
    assert_same_state(before, snapshot(flux2.pipe.transformer))


# -- text encoders from transformers, found by rule --------------------------------------------


def _clip_vision():
    from transformers import CLIPVisionConfig, CLIPVisionModelWithProjection

    config = CLIPVisionConfig(hidden_size=16, projection_dim=16, num_hidden_layers=2, num_attention_heads=2,
                              intermediate_size=32, image_size=32, patch_size=16)
    return enc.finish(CLIPVisionModelWithProjection(config))


#: name -> (builder, the stack the rule must find); the vision towers of the VLMs must stay out of it
ENCODERS = {
    "mistral3-one-layer": (lambda t: enc.mistral3(t, num_layers=1), tok.mistral_tokenizer, "model.language_model.layers"),
    "qwen2.5-vl": (enc.qwen2_5_vl, tok.qwen2_tokenizer, "model.language_model.layers"),
    "qwen3-vl": (enc.qwen3_vl, tok.qwen2_tokenizer, "model.language_model.layers"),
    "t5": (enc.t5_encoder, tok.t5_tokenizer, "encoder.block"),
    "umt5": (enc.umt5_encoder, tok.t5_tokenizer, "encoder.block"),
    "clip": (enc.clip_text, tok.clip_tokenizer, "encoder.layers"),
    "clip-projection": (enc.clip_text_with_projection, tok.clip_tokenizer, "text_model.encoder.layers"),
    "gemma2": (enc.gemma2, tok.gemma_tokenizer, "layers"),
    "llama": (enc.llama, tok.llama_tokenizer, "layers"),
    "llama-causal-lm": (lambda t: enc.llama(t, causal_lm=True), tok.llama_tokenizer, "model.layers"),
    "glm": (enc.glm, tok.byte_level_tokenizer, "layers"),
    "bert": (enc.bert, tok.bert_tokenizer, "encoder.layer"),
    "clip-vision": (lambda t: _clip_vision(), None, "vision_model.encoder.layers"),
}


@pytest.mark.parametrize("name", list(ENCODERS))
def test_transformers_encoders_stream_the_stack_beside_their_embeddings(name):
    build, tokenizer_factory, stack = ENCODERS[name]
    tokenizer = tokenizer_factory() if tokenizer_factory else None
    with enc.seeded(0):
        model = build(tokenizer)
    expected_blocks = list(model.get_submodule(stack))
    assert [b for _, b in find_blocks(model)] == expected_blocks
    if tokenizer is not None:
        encoded = tokenizer(["a cat sitting on a bench"], return_tensors="pt")
        inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    else:
        inputs = {"pixel_values": torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        expected = model(**inputs, output_hidden_states=True).hidden_states[-1]
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    assert len(handle.describe()[0]["streamed_blocks"]) == len(expected_blocks)
    for _ in range(2):
        with torch.no_grad():
            assert torch.equal(model(**inputs, output_hidden_states=True).hidden_states[-1], expected)
    assert handle.stats()["prefetch_misses"] == 0
    handle.disable()
