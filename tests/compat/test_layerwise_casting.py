"""diffusers' layerwise casting (float8 storage, bfloat16 compute) through every strategy, and
``storage_dtype=``, on the tiny FLUX.2, Wan 2.2, Qwen-Image and SD3 DiTs in bfloat16 and on their
tiny pipelines: outputs ``torch.equal`` to the same model with the same casting and no offload,
the float8 bytes what is packed and copied, no re-pack and no copy home per call, and the
refusals (a cast that cannot be run exactly, full fine-tuning of a float8-stored weight)."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import offload_core
from offload_core.interop.casting import casting_hooks
from offload_core.planning.fitting import pipeline_plan_inputs
from offload_core.discovery.pipelines import pipeline_modules
from offload_core.planning import make_plan
from offload_core.strategies.part import Part
from offload_core.tiny import build_pipeline
from offload_core.tiny.encoders import seeded
from offload_core.tiny.transformers import build_dit
from offload_core.weights.binding import Binding

from contract_models import ENABLE_OPTIONS
from denoisers import _SPECS, _input_generator, build_transformer
from helpers import chaos_backend, first_tensor, free_port, snapshot, assert_same_state

pytestmark = pytest.mark.fake_only("references are computed on the CPU, as the fake's device")

FP8 = torch.float8_e4m3fn
DITS = ["flux2", "wan-t2v", "qwen-image", "sd3"]
INPUTS = {name: make for name, _, _, make in _SPECS}


def bf16(name: str, heads: int | None = None) -> tuple[nn.Module, dict]:
    """The tiny DiT ``name`` in bfloat16 (``heads`` of width 8: wider than the zoo's two, so that
    the 512-byte alignment of each packed tensor does not hide what a narrower dtype saves)."""
    overrides = {} if heads is None else {"num_attention_heads": heads}
    if heads is not None and name == "sd3":
        overrides["caption_projection_dim"] = 8 * heads
    if heads is not None and name == "wan-t2v":
        overrides["ffn_dim"] = 16 * heads
    with seeded(0):
        model = build_dit(name, **overrides)
    with torch.no_grad():
        inputs = INPUTS[name](model, _input_generator(0))
    to = lambda v: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
    return model.to(torch.bfloat16), {k: to(v) for k, v in inputs.items()}


def cast(model: nn.Module) -> nn.Module:
    model.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)
    return model


@torch.no_grad()
def steps(model: nn.Module, inputs: dict, n: int = 2) -> list[torch.Tensor]:
    shifted = lambda k, v, s: v + 0.1 * s if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
    return [first_tensor(model(**{k: shifted(k, v, s) for k, v in inputs.items()})).clone() for s in range(n)]


def assert_equal(got: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), what


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("name", DITS)
def test_casting_before_enable_and_storage_dtype_equal_the_casting_alone(name, strategy):
    model, inputs = bf16(name)
    expected = steps(cast(model), inputs)
    for how in ("casting", "storage_dtype"):
        model, _ = bf16(name)
        options = {"storage_dtype": FP8} if how == "storage_dtype" else {}
        if how == "casting":
            cast(model)
        handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy], **options)
        assert_equal(steps(model, inputs), expected, f"{name}, {how}, {strategy}")
        handle.disable()
        hooks = [hook for _, hook in casting_hooks([model])]
        assert hooks and all(h.fn_ref.pre_forward == h.pre_forward for h in hooks), "diffusers' hooks not given back"
        assert_equal(steps(model, inputs), expected, f"{name}, {how}, {strategy}, after disable")


@pytest.mark.parametrize("name", DITS)
def test_layerwise_copies_the_stored_bytes(name):
    """Per forward, a cast model copies exactly its streamed blocks as stored (float8 where
    diffusers casts, bfloat16 where its skip patterns keep a layer): at most 0.60 of the bf16
    model's bytes, except SD3, whose AdaLN-Zero projections (``norm1.linear``, about a third of a
    block) diffusers' own pattern "norm" leaves in bfloat16 (0.68)."""
    copied = {}
    for casting in (False, True):
        model, inputs = bf16(name, heads=8)
        if casting:
            cast(model)
        handle = offload_core.enable_offload(model, backend=chaos_backend(), enable_layerwise_offload=True)
        before = handle.stats()
        steps(model, inputs, n=1)
        after = handle.stats()
        units = handle.parts[0].units
        copied[casting] = after["h2d_bytes"] - before["h2d_bytes"]
        assert copied[casting] == sum(u.nbytes for u in units), "a forward copies each block once, as stored"
        if casting:
            stored = {dtype for u in units for dtype in u.numel}
            assert FP8 in stored and after["pinned_host_bytes"] < pinned_bf16, "the homes are not narrow"
        pinned_bf16 = after["pinned_host_bytes"]
        handle.disable()
    ratio = copied[True] / copied[False]
    assert ratio <= (0.70 if name == "sd3" else 0.60), f"{name}: {ratio:.3f} of the bf16 bytes per forward"


def test_a_forward_repacks_nothing_and_copies_nothing_home(monkeypatch):
    """The casts of a layer's forward neither re-pack its part (an ``_apply``) nor send anything
    home when its block or component leaves the device (the cast back gives the device view back)."""
    repacks, homes = [], []
    repack, to_home = Part.repack, Binding.to_home
    monkeypatch.setattr(Part, "repack", lambda self, *a, **k: (repacks.append(self), repack(self, *a, **k))[1])

    def counted(self, write_back):
        return to_home(self, lambda pairs: (homes.append(len(pairs)), write_back(pairs))[1])

    monkeypatch.setattr(Binding, "to_home", counted)
    for strategy in ENABLE_OPTIONS:
        model, inputs = bf16("flux2")
        expected = steps(cast(bf16("flux2")[0]), inputs, n=3)
        handle = offload_core.enable_offload(cast(model), backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
        assert_equal(steps(model, inputs, n=3), expected, strategy)
        assert repacks == [] and homes == [], f"{strategy}: {len(repacks)} re-packs, copies home {homes}"
        handle.disable()


def test_casting_after_enable_is_taken_over_and_given_back():
    """The method after enable re-packs once; the function re-packs once per layer it casts and
    its hooks are taken over at their first forward; both equal the casting alone, and disable
    gives diffusers' hooks back."""
    from diffusers.hooks import apply_layerwise_casting

    model, inputs = bf16("flux2")
    expected = steps(cast(model), inputs)
    layers = len(list(casting_hooks([model])))
    for strategy in ENABLE_OPTIONS:
        for how in ("method", "function"):
            model, _ = bf16("flux2")
            handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
            part = handle.parts[0]
            repacks = []
            original = part.repack
            part.repack = lambda *a, **k: (repacks.append(1), original(*a, **k))[1]
            if how == "method":
                cast(model)
            else:
                apply_layerwise_casting(model, FP8, torch.bfloat16, skip_modules_pattern="auto")
            assert len(repacks) == (1 if how == "method" else layers), f"{strategy}, {how}: {len(repacks)} re-packs"
            assert_equal(steps(model, inputs), expected, f"{strategy}, {how}")
            taken = [h.fn_ref.pre_forward != h.pre_forward for _, h in casting_hooks([model])]
            assert len(taken) == layers and all(taken), "a hook casts through _apply"
            handle.disable()
            assert not any(h.fn_ref.pre_forward != h.pre_forward for _, h in casting_hooks([model]))
            assert_equal(steps(model, inputs), expected, f"{strategy}, {how}, after disable")


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_full_fine_tuning_of_a_float8_weight_is_refused(strategy):
    model, inputs = bf16("flux2")
    cast(model).requires_grad_(True)  # full fine-tuning: the float8-stored weights too
    expected = steps(model, inputs, n=1)
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    loss = first_tensor(model(**inputs)).float().square().mean()
    with pytest.raises(offload_core.OffloadedModelError, match=r"requires_grad_\(False\).*LoRA"):
        loss.backward()
    assert_equal(steps(model, inputs, n=1), expected, f"{strategy}: the model still runs")
    handle.disable()
    refusals = [h for p in model.parameters() for h in (p._backward_hooks or {}).values()]
    assert refusals == [], "the refusal outlives disable()"


@pytest.mark.parametrize("storage, compute, match", [
    (torch.float16, torch.bfloat16, "cannot hold every"),  # the cast back would change the stored weights
])
def test_a_cast_offloading_cannot_run_exactly_is_refused_untouched(storage, compute, match):
    model, _ = bf16("flux2")
    model.enable_layerwise_casting(storage_dtype=storage, compute_dtype=compute)
    before = snapshot(model)
    with pytest.raises(offload_core.OffloadConfigError, match=match):
        offload_core.enable_offload(model, backend=chaos_backend(), enable_layerwise_offload=True)
    assert_same_state(before, snapshot(model))


def test_casting_the_whole_model_at_once_is_refused_under_streaming():
    """A hook on the model itself (no skip pattern, no skip class) would cast every streamed block
    at once: refused for layerwise, before enable or as it attaches after, the model untouched;
    exact under model-level, where the whole model is on the device."""
    from diffusers.hooks import apply_layerwise_casting

    whole = functools.partial(apply_layerwise_casting, storage_dtype=FP8, compute_dtype=torch.bfloat16,
                              skip_modules_pattern=None)
    model, inputs = bf16("flux2")
    expected = steps(whole(model) or model, inputs, n=1)
    before = snapshot(model)
    with pytest.raises(offload_core.OffloadConfigError, match="as a whole"):
        offload_core.enable_offload(model, backend=chaos_backend(), enable_layerwise_offload=True)
    assert_same_state(before, snapshot(model))
    handle = offload_core.enable_offload(model, backend=chaos_backend(), enable_cpu_offload=True)
    assert_equal(steps(model, inputs, n=1), expected, "the whole model cast, model-level")
    handle.disable()
    for strategy in ENABLE_OPTIONS:  # attached after enable
        model, _ = bf16("flux2")
        handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
        if strategy == "layerwise":
            before = snapshot(model)
            with pytest.raises(offload_core.OffloadConfigError, match="as a whole"):
                whole(model)
            assert_same_state(before, snapshot(model))
        else:
            whole(model)
            assert_equal(steps(model, inputs, n=1), expected, "the whole model cast after enable, model-level")
        handle.disable()


@pytest.mark.parametrize("dtype, match", [
    (torch.bfloat16, "narrower than the weights"),
    (torch.float32, "narrower than the weights"),
    (torch.int8, "floating dtype"),
    ("float8_e4m3fn", "torch.dtype"),
])
def test_storage_dtype_must_be_a_floating_dtype_narrower_than_the_weights(dtype, match):
    model, _ = bf16("flux2")
    before = snapshot(model)
    with pytest.raises(offload_core.OffloadConfigError, match=match):
        offload_core.enable_offload(model, backend=chaos_backend(), enable_layerwise_offload=True, storage_dtype=dtype)
    assert_same_state(before, snapshot(model))
    assert next(casting_hooks([model]), None) is None


def test_storage_dtype_float8_e5m2_and_fp16_storage_of_fp32_weights():
    for name, weights, storage in (("wan-t2v", torch.bfloat16, torch.float8_e5m2),
                                   ("flux2", torch.float32, torch.float16)):
        model, inputs = build_transformer(name)
        model = model.to(weights)
        inputs = {k: v.to(weights) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
        reference, _ = build_transformer(name)
        reference.to(weights).enable_layerwise_casting(storage_dtype=storage, compute_dtype=weights)
        expected = steps(reference, inputs)
        handle = offload_core.enable_offload(model, backend=chaos_backend(), enable_layerwise_offload=True,
                                             storage_dtype=storage)
        assert storage in {d for u in handle.parts[0].units for d in u.numel}
        assert_equal(steps(model, inputs), expected, f"{name} stored in {storage}")
        handle.disable()


ACTIVATION = 64 * 2**10
PIPELINES = {"flux2": ("transformer",), "wan2.2-t2v": ("transformer", "transformer_2"), "qwen-image": ("transformer",),
             "sd3": ("transformer",)}


@pytest.mark.parametrize("name", PIPELINES)
def test_storage_dtype_on_a_pipeline_with_a_device_budget(name):
    """``enable_offload(pipe, device_memory=..., storage_dtype=...)``: the DiTs stored in float8,
    the planner's choice under a budget a quarter of the way from the smallest that works to all
    the weights, the output that of the pipeline whose DiTs have diffusers' casting."""
    reference = build_pipeline(name)
    for dit in PIPELINES[name]:
        getattr(reference.pipe, dit).enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.float32)
    expected = reference.run()
    tiny = build_pipeline(name)
    planned = pipeline_plan_inputs(tiny.pipe, pipeline_modules(tiny.pipe), cls_name=type(tiny.pipe).__name__)
    components = [c.with_measurements(activation_bytes=ACTIVATION) for c in planned.components]
    floor = make_plan(components, 2**40, strategy="layerwise", phases=planned.phases, steps=planned.steps).min_budget
    budget = floor + (sum(c.total_bytes for c in components) - floor) // 4  # some blocks kept, the others streamed
    for flag in ({}, {"enable_layerwise_offload": True}):  # the planner's choice (model-level here), layerwise
        handle = offload_core.enable_offload(tiny.pipe, device_memory=budget, activation_memory=ACTIVATION,
                                             storage_dtype=FP8, backend=chaos_backend(), **flag)
        assert torch.equal(tiny.run(), expected), f"{name} ({handle.strategy})"
        for dit in PIPELINES[name]:
            stored = [p.dtype for m, _ in casting_hooks([getattr(tiny.pipe, dit)]) for p in m.parameters()]
            assert stored and set(stored) == {FP8}, f"{dit} is not stored in float8"
        handle.disable()
        assert torch.equal(tiny.run(), expected), f"{name} after disable"
        tiny = build_pipeline(name)


WORLD = 2


def _worker(rank: int, port: int) -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 2)[0])  # tests/ helpers in the spawned process
    torch.set_num_threads(1)
    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    backend.init_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}")
    for name in DITS:
        model, inputs = bf16(name)
        expected = steps(cast(model), inputs)
        for how, shard in (("casting", True), ("storage_dtype", True), ("casting", False)):
            model, _ = bf16(name)
            options = {"storage_dtype": FP8} if how == "storage_dtype" else {}
            if how == "casting":
                cast(model)
            handle = offload_core.enable_offload(model, backend=backend, enable_distributed_layerwise_offload=True,
                                                 shard_host_weights=shard, **options)
            assert_equal(steps(model, inputs), expected, f"rank {rank}, {name}, {how}, shard={shard}")
            handle.disable()
            assert_equal(steps(model, inputs), expected, f"rank {rank}, {name}, {how}, after disable")


def test_distributed_on_two_ranks():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
