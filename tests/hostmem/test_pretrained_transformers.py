"""``offload_core.from_pretrained`` builds ``transformers`` models on the meta device with their
checkpoint tensors attached as file slices, and the result equals transformers' own
``from_pretrained``: state dicts, dtypes, ties and forward outputs, for the text encoders of the
supported pipelines; checkpoints the rules do not cover are read by transformers, with a log
line saying why."""

from __future__ import annotations

import logging
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

import offload_core
from offload_core.tiny import encoders as enc
from offload_core.tiny import tokenizers as tok

from helpers import chaos_backend, forward, snapshot

#: name -> a tiny encoder of the supported table and the pipeline sweep (offload_core.tiny.encoders)
ENCODERS = {
    "t5": lambda: enc.t5_encoder(tok.t5_tokenizer()),
    "umt5": lambda: enc.umt5_encoder(tok.t5_tokenizer()),
    "clip": lambda: enc.clip_text(tok.clip_tokenizer()),
    "clip-projection": lambda: enc.clip_text_with_projection(tok.clip_tokenizer()),
    "mistral3": lambda: enc.mistral3(tok.mistral_tokenizer()),
    "qwen2.5-vl": lambda: enc.qwen2_5_vl(tok.qwen2_tokenizer()),
    "qwen3-vl": lambda: enc.qwen3_vl(tok.qwen2_tokenizer()),
    "gemma2": lambda: enc.gemma2(tok.gemma_tokenizer()),
    "llama": lambda: enc.llama(tok.llama_tokenizer()),
    "llama-causal-lm": lambda: enc.llama(tok.llama_tokenizer(), causal_lm=True),
}


def saved(name: str, folder, **save_options):
    with enc.seeded(0):
        model = ENCODERS[name]()
    model.save_pretrained(folder, **save_options)
    return type(model)


def inputs_for(model) -> dict:
    vocab = model.config.get_text_config().vocab_size
    ids = torch.arange(3, 11).remainder(vocab).unsqueeze(0)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def state(model) -> dict:
    return {k: (t.dtype, t.clone()) for k, t in model.state_dict().items()}


def assert_same_model(got, reference) -> None:
    """Same class, mode, tensors (names, dtypes, values), non-persistent buffers and ties."""
    assert type(got) is type(reference) and not got.training
    expected, actual = state(reference), state(got)
    assert actual.keys() == expected.keys()
    for key, (dtype, value) in expected.items():
        assert actual[key][0] == dtype, key
        assert torch.equal(actual[key][1], value), key
    buffers = dict(reference.named_buffers())
    for name, buffer in got.named_buffers():
        assert buffer.dtype == buffers[name].dtype and torch.equal(buffer, buffers[name]), name
    assert snapshot(got)["sharing"] == snapshot(reference)["sharing"]


def attached(model) -> int:
    """How many of the model's tensors carry a checkpoint slice (are read at enable)."""
    from offload_core.weights.unit import SOURCE_ATTRIBUTE

    return sum(getattr(t, SOURCE_ATTRIBUTE, None) is not None for t in model.state_dict(keep_vars=True).values())


@pytest.mark.parametrize("name", ENCODERS)
def test_an_encoder_streams_from_its_own_checkpoint_and_equals_transformers_load(name, tmp_path):
    """Every block on disk (host_memory=0): each is read from the encoder's checkpoint when it
    runs, and the model equals transformers' load before, during and after offloading."""
    cls = saved(name, tmp_path)
    reference = cls.from_pretrained(tmp_path)
    expected = forward(reference, inputs_for(reference))
    from offload_core.pretrained.encoders import load_from_checkpoint

    built = load_from_checkpoint(cls, str(tmp_path), None)
    tensors = built.state_dict(keep_vars=True)
    assert attached(built) == len(tensors) and all(t.is_meta for t in tensors.values())
    assert not any(b.is_meta for n, b in built.named_buffers() if n not in tensors)  # computed at init: rotary tables
    handle = offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, backend=chaos_backend(),
                                          host_memory=0)
    model = handle.target
    assert handle.stats()["disk_bytes"] > 0
    for _ in range(2):
        assert torch.equal(forward(model, inputs_for(model)), expected)
    handle.disable()
    assert_same_model(model, reference)
    assert torch.equal(forward(model, inputs_for(model)), expected)


@pytest.mark.parametrize("name, dtype", [("t5", torch.float16), ("umt5", torch.bfloat16), ("qwen2.5-vl", torch.bfloat16),
                                         ("mistral3", torch.float16)])
def test_dtypes_follow_transformers_rules(name, dtype, tmp_path):
    """``dtype`` converts the floating tensors on the way in; T5's ``wo`` stays fp32 in fp16
    (``_keep_in_fp32_modules``), in bf16 it does not."""
    cls = saved(name, tmp_path)
    reference = cls.from_pretrained(tmp_path, dtype=dtype)
    handle = offload_core.from_pretrained(tmp_path, torch_dtype=dtype, enable_layerwise_offload=True,
                                          backend=chaos_backend())
    model = handle.target
    assert torch.equal(forward(model, inputs_for(model)), forward(reference, inputs_for(reference)))
    handle.disable()
    assert_same_model(model, reference)
    if name == "t5":
        assert model.encoder.block[0].layer[1].DenseReluDense.wo.weight.dtype == torch.float32
        assert model.shared.weight.dtype == torch.float16


def test_a_sharded_checkpoint_and_an_old_key_layout_are_read_as_transformers_reads_them(tmp_path):
    """Mistral-3 saved from scratch is written in transformers' older (llava) key layout, which
    its load renames; sharded, each block comes from its own shard."""
    cls = saved("mistral3", tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / "model.safetensors.index.json").exists()
    reference = cls.from_pretrained(tmp_path)
    handle = offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, backend=chaos_backend(),
                                          host_memory=0)
    model = handle.target
    assert torch.equal(forward(model, inputs_for(model)), forward(reference, inputs_for(reference)))
    handle.disable()
    assert_same_model(model, reference)
    assert [type(c).__name__ for c in model._weight_conversions] == \
        [type(c).__name__ for c in reference._weight_conversions]


def test_a_tie_whose_two_tensors_are_both_saved_is_tied_when_they_are_equal(tmp_path):
    """T5's ``encoder.embed_tokens`` is tied to ``shared``: a checkpoint holding both (equal)
    loads tied, as transformers loads it; with different values they stay apart."""
    from offload_core.pretrained.encoders import load_from_checkpoint

    cls = saved("t5", tmp_path)
    path = tmp_path / "model.safetensors"
    tensors = load_file(path)
    tensors["encoder.embed_tokens.weight"] = tensors["shared.weight"].clone()
    save_file(tensors, path, metadata={"format": "pt"})
    for equal in (True, False):
        if not equal:
            tensors["encoder.embed_tokens.weight"][0] += 1
            save_file(tensors, path, metadata={"format": "pt"})
        reference = cls.from_pretrained(tmp_path)
        model = load_from_checkpoint(cls, str(tmp_path), None)
        assert (model.encoder.embed_tokens.weight is model.shared.weight) is equal
        assert (reference.encoder.embed_tokens.weight is reference.shared.weight) is equal
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
        assert torch.equal(forward(model, inputs_for(model)), forward(reference, inputs_for(reference)))
        handle.disable()
        assert_same_model(model, reference)


def _drop_a_weight(folder) -> None:
    path = folder / "model.safetensors"
    tensors = load_file(path)
    del tensors["encoder.final_layer_norm.weight"]
    save_file(tensors, path, metadata={"format": "pt"})


def _as_pickle(folder) -> None:
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save(tensors, folder / "pytorch_model.bin")


@pytest.mark.parametrize("change, why", [(_drop_a_weight, "1 weights are missing from the checkpoint"),
                                         (_as_pickle, "its weights are not safetensors")],
                         ids=["missing-weight", "pickle"])
def test_what_the_rules_do_not_cover_is_read_by_transformers_with_a_log_line(change, why, tmp_path, caplog):
    from offload_core.pretrained.encoders import load_from_checkpoint

    cls = saved("umt5", tmp_path)
    change(tmp_path)
    with caplog.at_level(logging.INFO, logger="offload_core.pretrained.encoders"):
        model = load_from_checkpoint(cls, str(tmp_path), None)
    assert why in caplog.text and "transformers reads its checkpoint" in caplog.text
    assert attached(model) == 0 and not any(t.is_meta for t in model.state_dict().values())
    torch.manual_seed(0)  # a missing weight is initialised at random: the same draw for both
    model = load_from_checkpoint(cls, str(tmp_path), None)
    torch.manual_seed(0)
    assert_same_model(model, cls.from_pretrained(tmp_path))


def test_transformers_own_reading_is_back_in_place_after_a_load(tmp_path):
    """Only the model of the call is read as slices: a later plain load reads tensors."""
    from transformers import PreTrainedModel

    from offload_core.pretrained import encoders as pt

    cls = saved("llama", tmp_path)
    original = PreTrainedModel.__dict__["_load_pretrained_model"]
    assert attached(pt.load_from_checkpoint(cls, str(tmp_path), None)) > 0
    assert PreTrainedModel.__dict__["_load_pretrained_model"] is original
    assert attached(cls.from_pretrained(tmp_path)) == 0


@pytest.mark.parametrize("name", ["wan2.2-t2v", "flux2", "qwen-image"])
def test_a_pipelines_text_encoder_streams_from_its_checkpoint(name, tmp_path):
    """``components=("dit", "text_encoder")`` with every block on disk: the encoder's blocks are
    read from its own checkpoint (no offload_folder), and the pipeline's output equals diffusers'
    own load without offload."""
    import diffusers
    from offload_core.tiny import TinyPipeline, build_pipeline

    tiny = build_pipeline(name)
    tiny.pipe.save_pretrained(tmp_path)
    reference = getattr(diffusers, type(tiny.pipe).__name__).from_pretrained(tmp_path)
    for tensor in [*reference.text_encoder.parameters(), *reference.transformer.parameters()]:
        # weights read from a mapped file may start anywhere; kernels pick their path by alignment,
        # and offloaded weights start at aligned addresses: compare alike
        tensor.data = tensor.data.clone()
    reference.set_progress_bar_config(disable=True)
    expected = TinyPipeline("reference", reference, tiny.call_kwargs, tiny.output_attr).run(seed=0)
    handle = offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, components=("dit", "text_encoder"),
                                          host_memory=0, backend=chaos_backend())
    pipe = handle.target
    encoder = next(p for p in handle.parts if getattr(p, "model", None) is pipe.text_encoder)
    assert encoder.units and all(u.image is not None for u in encoder.units)  # streamed, from disk
    pipe.set_progress_bar_config(disable=True)
    got = TinyPipeline("offloaded", pipe, tiny.call_kwargs, tiny.output_attr)
    for _ in range(2):
        assert torch.equal(got.run(seed=0), expected)
    handle.disable()
    assert_same_model(pipe.text_encoder, reference.text_encoder)


def test_the_refusal_names_the_component_whose_blocks_cannot_stay_on_disk(tmp_path):
    """A text encoder read by transformers (its weights pickled) holds its values in memory: with
    host_memory=0 its blocks have nowhere to be read from, and the error names it, not the DiTs,
    whose blocks stay in their checkpoint."""
    from offload_core.tiny import build_pipeline

    build_pipeline("wan2.2-t2v").pipe.save_pretrained(tmp_path)
    _as_pickle(tmp_path / "text_encoder")
    with pytest.raises(offload_core.OffloadConfigError) as caught:
        offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, components=("dit", "text_encoder"),
                                     host_memory=0, backend=chaos_backend())
    named, _, advice = str(caught.value).partition(" out of RAM")
    assert re.fullmatch(r"host_memory=0 leaves 2 blocks \(.+\) of text_encoder \(UMT5EncoderModel\)", named), named
    assert "offload_core.from_pretrained" in advice and "offload_folder=" in advice
    handle = offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, components=("dit", "text_encoder"),
                                          host_memory=0, backend=chaos_backend(), offload_folder=tmp_path / "spill")
    handle.disable()


def test_ram_goes_to_the_blocks_read_every_step_before_a_text_encoders(tmp_path):
    """A budget that holds every DiT block and half of the encoder's: the encoder (read once per
    prompt) is the one whose blocks stay in its checkpoint, not the DiTs (read every step), though
    the pipeline runs the encoder first; and the plan's host tiers say the same."""
    from offload_core.hostmem.placement import BOUNCE_BUFFERS, aligned, ring_chunk_bytes, ring_reserve
    from offload_core.planning.components import Component
    from offload_core.planning.hosttiers import host_tiers
    from offload_core.planning.plan import ComponentPlan
    from offload_core.tiny import build_pipeline

    build_pipeline("wan2.2-t2v").pipe.save_pretrained(tmp_path)
    options = dict(enable_layerwise_offload=True, components=("dit", "text_encoder"), backend=chaos_backend())
    handle = offload_core.from_pretrained(tmp_path, **options)
    encoder_model = handle.target.text_encoder
    units = {id(p): p.host_units() for p in handle.parts if hasattr(p, "transport")}
    encoder_blocks = sum(h.nbytes for p in handle.parts if getattr(p, "model", None) is encoder_model
                         for h in units[id(p)][1:])
    everything = sum(h.nbytes for p in handle.parts for h in p.host_units())
    largest = max(n * d.itemsize for p in handle.parts for h in p.host_units() for d, n in h.unit.numel.items())
    handle.disable()
    budget = everything - encoder_blocks // 2 + ring_reserve(largest, disk=True)
    # nothing pinned but the bounce ring: its reserve is taken whatever the budget
    handle = offload_core.from_pretrained(tmp_path, host_memory=budget, pinned_memory=0, **options)
    streamed = [p for p in handle.parts if hasattr(p, "transport")]
    on_disk = {p.label: [u.image is not None for u in p.units] for p in streamed}
    assert any(on_disk["text_encoder"]) and not all(on_disk["text_encoder"]), on_disk
    assert not any(on_disk["transformer"]) and not any(on_disk["transformer_2"]), on_disk
    handle.disable()

    components = [Component("text_encoder", "text_encoder", 0, (100,) * 4), Component("transformer", "dit", 0, (100,) * 4)]
    plans = [ComponentPlan(c.name, c.kind, "streamed", 400, 0, 0, "given", streamed_blocks=tuple(range(4)))
             for c in components]
    ring = BOUNCE_BUFFERS * aligned(ring_chunk_bytes(100))
    tiers, _ = host_tiers(plans, components, ring + 600, 0)
    assert [t.host["disk"] for t in tiers] == [200, 0]


def test_a_transformers_whose_loading_internals_differ_loads_the_model_itself(tmp_path, monkeypatch, caplog):
    """Where the stand-in for transformers' reading step cannot be imported (another transformers
    version), transformers loads the model as usual, with a log line saying so, and offloading
    still works exactly."""
    import sys

    cls = saved("t5", tmp_path)
    reference = cls.from_pretrained(tmp_path)
    expected = forward(reference, inputs_for(reference))
    monkeypatch.setitem(sys.modules, "offload_core.pretrained.encoders", None)  # its import raises
    with caplog.at_level(logging.INFO, logger="offload_core.pretrained.load"):
        handle = offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, backend=chaos_backend())
    assert any("loading internals" in r.getMessage() for r in caplog.records)
    model = handle.target
    assert torch.equal(forward(model, inputs_for(model)), expected)
    handle.disable()
    assert_same_model(model, reference)
