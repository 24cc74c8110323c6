"""The tiny model zoo (offload_core.tiny) is what the offloading tests compare against, so it must be right:
every pipeline runs end to end, every model is deterministic, every block list it declares is really there,
and the stand-ins carry the awkward features they are meant to stress an offloader with."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing here may reach the hub

pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from offload_core.tiny import PIPELINES, build_pipeline  # noqa: E402

from denoisers import TRANSFORMERS, build_transformer  # noqa: E402
from standins import STANDINS, build_standin  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def _single_thread():
    """Tiny models only pay for intra-op threads: on a loaded 2-core machine one thread is ~5x faster."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tensors(obj):
    """Every tensor in a (nested) model output, in order."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _assert_same_outputs(a, b):
    ta, tb = list(_tensors(a)), list(_tensors(b))
    assert ta and len(ta) == len(tb)
    for x, y in zip(ta, tb):
        assert torch.equal(x, y)


def _assert_same_weights(m1: torch.nn.Module, m2: torch.nn.Module):
    s1, s2 = m1.state_dict(), m2.state_dict()
    assert s1.keys() == s2.keys()
    for key in s1:
        assert torch.equal(s1[key], s2[key]), key


def _modules_of(pipe) -> dict[str, torch.nn.Module]:
    return {name: c for name, c in pipe.components.items() if isinstance(c, torch.nn.Module)}


def _block_attrs_for(model: torch.nn.Module) -> tuple[str, ...]:
    for spec in (*TRANSFORMERS.values(), *STANDINS.values()):
        if spec.cls_name == type(model).__name__:
            return spec.block_attrs
    raise AssertionError(f"no block attributes recorded for {type(model).__name__}")


def _check_block_attrs(model: torch.nn.Module, attrs: tuple[str, ...]):
    assert attrs
    for attr in attrs:
        blocks = getattr(model, attr, None)
        assert isinstance(blocks, torch.nn.ModuleList), f"{type(model).__name__}.{attr} is not a ModuleList"
        assert len(blocks) >= 2, f"{type(model).__name__}.{attr} has {len(blocks)} block(s)"


# ----------------------------------------------------------------------------------------------------------------
# Pipelines
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=list(PIPELINES))
def built(request):
    """One build per pipeline for the whole module, with its seed-0 output as the reference."""
    tiny = build_pipeline(request.param, seed=0)
    return tiny, tiny.run(seed=0)


@pytest.fixture
def tiny(built):
    return built[0]


def test_pipeline_runs_deterministically(built):
    tiny, reference = built
    assert torch.equal(tiny.run(seed=0), reference)
    assert reference.dtype == torch.float32
    assert torch.isfinite(reference).all()
    assert reference.min() >= 0 and reference.max() <= 1  # postprocessed images
    assert reference.std() > 1e-3  # not a constant image

    kwargs = tiny.call_kwargs
    height, width = kwargs["height"], kwargs["width"]
    if kwargs.get("num_frames", 1) > 1:  # (batch, frames, channels, height, width)
        assert tuple(reference.shape) == (1, kwargs["num_frames"], 3, height, width)
    else:  # (batch or frames, channels, height, width)
        assert tuple(reference.shape) == (1, 3, height, width)


def test_pipeline_is_the_named_class_in_float32(tiny):
    spec = PIPELINES[tiny.name]
    assert type(tiny.pipe).__name__ == spec.cls_name
    for name, module in _modules_of(tiny.pipe).items():
        dtypes = {p.dtype for p in module.parameters()}
        assert dtypes == {torch.float32}, f"{name}: {dtypes}"
        assert all(p.device.type == "cpu" for p in module.parameters())


def test_pipeline_builds_are_identical_for_a_seed(built):
    tiny, reference = built
    again = build_pipeline(tiny.name, seed=0)
    ours, theirs = _modules_of(tiny.pipe), _modules_of(again.pipe)
    assert ours.keys() == theirs.keys()
    for name in ours:
        _assert_same_weights(ours[name], theirs[name])
    assert torch.equal(again.run(seed=0), reference)


def test_every_denoiser_runs_and_has_its_blocks(built):
    """Each denoiser (both Wan 2.2 experts included) is called, and the seed is what the output depends on."""
    tiny, reference = built
    calls: dict[str, int] = {}
    handles = []
    for name in PIPELINES[tiny.name].denoisers:
        model = getattr(tiny.pipe, name)
        _check_block_attrs(model, _block_attrs_for(model))
        calls[name] = 0

        def count(_module, _args, _output, name=name):
            calls[name] += 1

        handles.append(model.register_forward_hook(count))
    try:
        other = tiny.run(seed=1)
    finally:
        for handle in handles:
            handle.remove()
    assert all(n >= 1 for n in calls.values()), calls
    assert not torch.equal(other, reference)


def test_wan22_t2v_uses_both_experts():
    tiny = build_pipeline("wan2.2-t2v")
    assert tiny.pipe.config.boundary_ratio is not None
    calls = {"transformer": 0, "transformer_2": 0}
    handles = [
        getattr(tiny.pipe, name).register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
        for name in calls
    ]
    try:
        tiny.run(seed=0)
    finally:
        for handle in handles:
            handle.remove()
    assert calls["transformer"] >= 1 and calls["transformer_2"] >= 1, calls
    assert tiny.pipe.transformer is not tiny.pipe.transformer_2


def test_unknown_pipeline_names_the_known_ones():
    with pytest.raises(KeyError, match="flux2"):
        build_pipeline("no-such-pipeline")


# ----------------------------------------------------------------------------------------------------------------
# Transformers and stand-ins
# ----------------------------------------------------------------------------------------------------------------

_MODELS = [("transformer", name) for name in TRANSFORMERS] + [("standin", name) for name in STANDINS]


def _build(kind: str, name: str, seed: int = 0):
    return build_transformer(name, seed) if kind == "transformer" else build_standin(name, seed)


def _spec(kind: str, name: str):
    return TRANSFORMERS[name] if kind == "transformer" else STANDINS[name]


@pytest.mark.parametrize("kind,name", _MODELS, ids=[name for _, name in _MODELS])
def test_model_forward_is_deterministic(kind, name):
    model, inputs = _build(kind, name)
    spec = _spec(kind, name)
    assert type(model).__name__ == spec.cls_name
    assert not model.training
    _check_block_attrs(model, spec.block_attrs)

    with torch.no_grad():
        out = model(**inputs)
        again = model(**inputs)
    _assert_same_outputs(out, again)
    assert all(torch.isfinite(t).all() for t in _tensors(out))

    model_2, inputs_2 = _build(kind, name)
    _assert_same_weights(model, model_2)
    with torch.no_grad():
        _assert_same_outputs(out, model_2(**inputs_2))


@pytest.mark.parametrize("kind,name", _MODELS, ids=[name for _, name in _MODELS])
def test_every_block_contributes_to_the_output(kind, name):
    """Offload tests compare outputs with torch.equal: a block whose weights did not matter would hide bugs."""
    model, inputs = _build(kind, name)
    with torch.no_grad():
        reference = list(_tensors(model(**inputs)))
        for attr in _spec(kind, name).block_attrs:
            for index in (0, -1):
                block = getattr(model, attr)[index]
                saved = {k: v.clone() for k, v in block.state_dict().items()}
                for param in block.parameters():
                    param.mul_(1.5)
                changed = list(_tensors(model(**inputs)))
                block.load_state_dict(saved)
                assert any(not torch.equal(a, b) for a, b in zip(reference, changed)), f"{attr}[{index}]"


def test_transformer_configs_match_diffusers_block_lists():
    """The recorded block lists are all the ModuleLists directly on each class (no list left unrecorded)."""
    for name, spec in TRANSFORMERS.items():
        model, _ = build_transformer(name)
        module_lists = {n for n, child in model.named_children() if isinstance(child, torch.nn.ModuleList)}
        assert set(spec.block_attrs) <= module_lists, name
        # UNets also hold a ModuleList of attention processors elsewhere; DiTs have only their block lists.
        if spec.cls_name != "UNet2DConditionModel":
            assert module_lists == set(spec.block_attrs), (name, module_lists)


def test_standins_carry_the_features_they_stress():
    nextstep, _ = build_standin("NextStepModel")
    assert nextstep.lm_head.weight is nextstep.embed_tokens.weight  # tied, outside the blocks
    buffers = dict(nextstep.named_buffers())
    assert "layers.0.rotary_emb.inv_freq" in buffers
    assert "layers.0.rotary_emb.inv_freq" not in nextstep.state_dict()  # persistent=False

    mot, _ = build_standin("Qwen2MoTModel")
    layer_dtypes = {p.dtype for p in mot.layers[0].parameters()}
    assert layer_dtypes == {torch.float32, torch.bfloat16}
    assert mot.layers[0].mlp_moe_gen.gate_proj.weight.dtype == torch.bfloat16
    for outside in ("vae2llm", "time_embedder", "llm2vae", "latent_pos_embed"):
        assert hasattr(mot, outside)

    vfm, _ = build_standin("Cosmos3VFMTransformer")
    assert not vfm.layers[0].modulation.is_contiguous()

    lm, _ = build_standin("Cosmos3LanguageModel")
    order: list[str] = []
    for attr in ("layers", "gen_layers"):
        for index, block in enumerate(getattr(lm, attr)):
            block.register_forward_pre_hook(lambda *_, tag=f"{attr}[{index}]": order.append(tag))
    _, inputs = build_standin("Cosmos3LanguageModel")
    with torch.no_grad():
        lm(**inputs)
    assert order == ["layers[0]", "layers[1]", "gen_layers[0]", "gen_layers[1]"]

    from diffusers import UNet2DConditionModel

    unet, _ = build_standin("SDXLUNet2DConditionModel")
    assert isinstance(unet, UNet2DConditionModel)
    assert unet.config.addition_embed_type == "text_time"
