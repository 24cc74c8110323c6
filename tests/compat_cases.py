"""The checks behind docs/compatibility.md: one function per row of ``ROWS`` in
``tools/compatibility.py``, run once per strategy ("model", "layerwise", "distributed"); the
torch.compile rows' checks are in compat/compile_cases.py, which compat/test_compile.py runs.

Each check builds tiny diffusers models in code, applies the feature without offload to get the
reference, then with offload (on the given backend, in chaos mode) and compares outputs with
``torch.equal``; or, for a refused feature, checks the error and that the model is untouched.
tests/compat/test_compatibility.py runs the model-level and layerwise cells, and the distributed cells
on two gloo processes, where the process group is already initialised.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from typing import Callable, Iterator

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map

import offload_core
from offload_core.discovery import find_blocks
from offload_core.weights.unit import ALIGN_BYTES

from denoisers import build_transformer
from helpers import first_tensor
from tools.compatibility import KEPT, REFUSED, YES

OPTIONS = {
    "model": {"enable_cpu_offload": True},
    "layerwise": {"enable_layerwise_offload": True},
    "distributed": {"enable_distributed_layerwise_offload": True},
}

STEPS = 3


def perturbed(inputs: dict, step: int, scale: float) -> dict:
    """The same call with the floating inputs shifted, as successive denoising steps would be."""
    return {k: v + scale * step if isinstance(v, torch.Tensor) and v.is_floating_point() else v for k, v in inputs.items()}


@torch.no_grad()
def run_steps(call: Callable, inputs: dict, steps: int = STEPS, scale: float = 0.1) -> list[torch.Tensor]:
    return [first_tensor(call(**perturbed(inputs, s, scale))).clone() for s in range(steps)]


def assert_equal(outputs: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    for step, (out, ref) in enumerate(zip(outputs, expected)):
        assert torch.equal(out, ref), f"{what}: step {step} differs from the same setup without offload"


def expect(verdict: str, *kinds: str) -> str:
    """The kind of ``verdict`` (a table cell: "yes (inductor)" is "yes"), which must be one this check can prove."""
    kind = verdict.split(" (")[0]
    assert kind in kinds, f"the table says {verdict!r}, which this check cannot prove (it checks {kinds})"
    return kind


def dynamo_backend(verdict: str) -> str:
    """The Dynamo backend a torch.compile cell names: "yes (inductor)" -> "inductor"."""
    return verdict.split("(")[1].rstrip(")") if "(" in verdict else "aot_eager"


@contextlib.contextmanager
def offloaded(model: nn.Module, strategy: str, backend) -> Iterator[offload_core.OffloadHandle]:
    handle = offload_core.enable_offload(model, backend=backend, **OPTIONS[strategy])
    try:
        yield handle
    finally:
        handle.disable()


# -- quantized weights --------------------------------------------------------------------------

def _leaves(t: torch.Tensor) -> list[torch.Tensor]:
    if not is_traceable_wrapper_subclass(t):
        return [t]
    return [leaf for name in t.__tensor_flatten__()[0] for leaf in _leaves(getattr(t, name))]


def _payload(model: nn.Module) -> tuple[int, int]:
    """(bytes, tensors) the model really holds: a quantized weight counts its parts."""
    leaves = {id(leaf): leaf for t in [*model.parameters(), *model.buffers()] for leaf in _leaves(t)}
    return sum(t.untyped_storage().nbytes() for t in leaves.values()), len(leaves)


def _buffers(handle: offload_core.OffloadHandle) -> list[torch.Tensor]:
    """Every flat buffer the strategies hold: host homes, device slots."""
    found = []
    for part in handle.parts:
        units = [*getattr(part, "units", []), *([part.resident] if hasattr(part, "resident") else [])]
        units += [c.unit for g in getattr(part, "groups", []) for c in g.components]
        found += [buf for u in units for buf in u.host.values()]
        found += [buf for slot in getattr(part, "slots", []) for buf in slot.values()]
        found += [buf for g in getattr(part, "groups", []) for c in g.components for buf in (c.device or {}).values()]
    return found


def _assert_streamed(blocks: list[nn.Module], kind: type, handle: offload_core.OffloadHandle, step: Callable) -> None:
    """Each ``kind`` weight of the blocks computes, during ``step()``, on parts read from the
    strategy's buffers, not on the tensors it was built with. Seen from inside each block's call:
    outside it a block shows its host buffer, or placeholders where the host holds only a shard."""
    seen: list[tuple[int, list[tuple[int, int]]]] = []  # (where a part is, the buffers then)

    def record(block: nn.Module, args: tuple) -> None:
        spans = [(b.data_ptr(), b.data_ptr() + b.nbytes) for b in _buffers(handle)]
        seen.extend((leaf.data_ptr(), spans) for p in block.parameters() if isinstance(p, kind) for leaf in _leaves(p))

    hooks = [block.register_forward_pre_hook(record) for block in blocks]
    try:
        step()
    finally:
        for hook in hooks:
            hook.remove()
    assert seen, f"no {kind.__name__} weight was called"
    for pointer, spans in seen:
        assert any(lo <= pointer < hi for lo, hi in spans), f"a {kind.__name__} part is not streamed"


def _check_quantized(strategy: str, backend, verdict: str, quantize: Callable[[nn.Module], None], kind: type) -> None:
    expect(verdict, YES)
    model, inputs = build_transformer("flux2")
    quantize(model)
    blocks = [block for _, block in find_blocks(model)]
    assert any(isinstance(p, kind) for b in blocks for p in b.parameters()), f"no {kind.__name__} in the blocks"
    expected = run_steps(model, inputs)
    payload, tensors = _payload(model)
    saved = {k: [leaf.clone() for leaf in _leaves(v)] for k, v in model.state_dict().items()}
    with offloaded(model, strategy, backend) as handle:
        assert_equal(run_steps(model, inputs), expected, f"{kind.__name__}, {strategy}")
        _assert_streamed(blocks, kind, handle, lambda: run_steps(model, inputs, steps=1))
        stats = handle.stats()
        if strategy != "distributed":  # the quantized parts are what is pinned: nothing dequantized, nothing left out
            assert payload <= stats["pinned_host_bytes"] <= payload + ALIGN_BYTES * tensors
            state = model.state_dict()  # from the host copy: the quantized weights as they were
            assert all(torch.equal(a, b) for k, v in state.items() for a, b in zip(_leaves(v), saved[k], strict=True))
            part = handle.parts[0]  # one copy per dtype of each streamed unit per step
            units = part.units if strategy == "layerwise" else [c.unit for g in part.groups for c in g.components]
            copies = stats["h2d_copies"]
            run_steps(model, inputs, steps=1)
            assert handle.stats()["h2d_copies"] - copies == sum(len(u.host) for u in units)
    assert any(isinstance(p, kind) for b in blocks for p in b.parameters()), "disable lost the quantized type"
    assert_equal(run_steps(model, inputs), expected, f"{kind.__name__} after disable")


def torchao_int8(strategy: str, backend, verdict: str) -> None:
    from torchao.quantization import Int8Tensor, Int8WeightOnlyConfig, quantize_

    _check_quantized(strategy, backend, verdict, lambda m: quantize_(m, Int8WeightOnlyConfig(version=2)), Int8Tensor)


def torchao_int8_legacy(strategy: str, backend, verdict: str) -> None:
    from torchao.dtypes import AffineQuantizedTensor
    from torchao.quantization import Int8WeightOnlyConfig, quantize_

    def apply(model: nn.Module) -> None:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Config Deprecation: version 1")
            quantize_(model, Int8WeightOnlyConfig(version=1))

    _check_quantized(strategy, backend, verdict, apply, AffineQuantizedTensor)


def _to_gguf(module: nn.Module) -> None:
    """Every Linear as diffusers' GGUFLinear: Q8_0 where the input width is a multiple of its
    32-value blocks, BF16 elsewhere, quantized by the gguf package as a GGUF file would hold it."""
    import gguf
    from diffusers.quantizers.gguf.utils import GGUFLinear, GGUFParameter

    for name, child in list(module.named_children()):
        if not isinstance(child, nn.Linear):
            _to_gguf(child)
            continue
        qtype = gguf.GGMLQuantizationType.Q8_0 if child.in_features % 32 == 0 else gguf.GGMLQuantizationType.BF16
        layer = GGUFLinear(child.in_features, child.out_features, child.bias is not None, compute_dtype=torch.float32)
        data = torch.from_numpy(gguf.quants.quantize(child.weight.detach().numpy(), qtype))
        layer.weight = GGUFParameter(data, quant_type=qtype)
        layer.bias = child.bias
        layer.requires_grad_(False)
        setattr(module, name, layer)


def gguf(strategy: str, backend, verdict: str) -> None:
    from diffusers.quantizers.gguf.utils import GGUFParameter

    _check_quantized(strategy, backend, verdict, _to_gguf, GGUFParameter)
    model, _ = build_transformer("flux2")
    _to_gguf(model)
    with offloaded(model, strategy, backend):
        kinds = {p.quant_type for p in model.parameters() if isinstance(p, GGUFParameter)}
    assert len(kinds) == 2, "both Q8_0 and BF16 weights are exercised"


def quanto_qint8(strategy: str, backend, verdict: str) -> None:
    from optimum.quanto import freeze, qint8, quantize
    from optimum.quanto.tensor.weights.qbytes import WeightQBytesTensor

    def apply(model: nn.Module) -> None:
        quantize(model, weights=qint8)
        freeze(model)

    _check_quantized(strategy, backend, verdict, apply, WeightQBytesTensor)


class Opaque(torch.Tensor):
    """A wrapper subclass without ``__tensor_flatten__``: the packer cannot reach its data."""

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        t = torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=data.device,
                                                strides=data.stride())
        t.inner = data
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:  # nn.Parameter(...) detaches: stay opaque
            return Opaque(args[0].inner.detach())
        unwrap = lambda x: x.inner if isinstance(x, Opaque) else x  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def opaque_subclass(strategy: str, backend, verdict: str) -> None:
    expect(verdict, KEPT)
    model, inputs = build_transformer("flux2")
    layer = find_blocks(model)[1][1].ff.linear_out
    layer.weight = nn.Parameter(Opaque(layer.weight.detach()), requires_grad=False)
    param = layer.weight
    expected = run_steps(model, inputs)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger("offload_core")
    logger.addHandler(handler)
    try:
        with offloaded(model, strategy, backend):
            lines = [r.getMessage() for r in records if "cannot be streamed" in r.getMessage()]
            assert len(lines) == 1 and "Opaque without __tensor_flatten__" in lines[0], lines
            assert layer.weight is param and type(layer.weight) is Opaque
            assert_equal(run_steps(model, inputs), expected, f"kept subclass, {strategy}")
    finally:
        logger.removeHandler(handler)
    assert layer.weight is param
    assert_equal(run_steps(model, inputs), expected, "kept subclass after disable")


# -- diffusers hooks ----------------------------------------------------------------------------

def _cached_steps(model: nn.Module, inputs: dict) -> list[torch.Tensor]:
    with model.cache_context("cond"):
        return run_steps(model, inputs, steps=4, scale=0.01)


def _check_cache(strategy: str, backend, verdict: str, name: str, config: Callable[[], object]) -> None:
    expect(verdict, YES)
    model, inputs = build_transformer(name)
    plain = _cached_steps(model, inputs)
    model.enable_cache(config())
    expected = _cached_steps(model, inputs)
    assert any(not torch.equal(a, b) for a, b in zip(plain, expected)), "the cache never skipped work"
    for when in ("before", "after"):
        model, _ = build_transformer(name)
        if when == "before":
            model.enable_cache(config())
        with offloaded(model, strategy, backend):
            if when == "after":
                model.enable_cache(config())
            assert_equal(_cached_steps(model, inputs), expected, f"cache attached {when} enable, {strategy}")


def first_block_cache(strategy: str, backend, verdict: str) -> None:
    from diffusers.hooks import FirstBlockCacheConfig

    _check_cache(strategy, backend, verdict, "wan-t2v", lambda: FirstBlockCacheConfig(threshold=0.3))


def pyramid_attention_broadcast(strategy: str, backend, verdict: str) -> None:
    from diffusers.hooks import PyramidAttentionBroadcastConfig

    _check_cache(strategy, backend, verdict, "flux2", lambda: PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1000),
        current_timestep_callback=lambda: 500))


def taylorseer_cache(strategy: str, backend, verdict: str) -> None:
    from diffusers.hooks import TaylorSeerCacheConfig

    _check_cache(strategy, backend, verdict, "flux2", lambda: TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1))


def mag_cache(strategy: str, backend, verdict: str) -> None:
    from diffusers.hooks import MagCacheConfig

    _check_cache(strategy, backend, verdict, "flux2", lambda: MagCacheConfig(num_inference_steps=4, mag_ratios=[1.0] * 4))


def attention_backend(strategy: str, backend, verdict: str) -> None:
    from diffusers.models.attention import AttentionModuleMixin

    expect(verdict, YES)
    model, inputs = build_transformer("flux2")
    expected_default = run_steps(model, inputs)
    model.set_attention_backend("_native_math")
    expected = run_steps(model, inputs)
    for when in ("before", "after"):
        model, _ = build_transformer("flux2")
        if when == "before":
            model.set_attention_backend("_native_math")
        with offloaded(model, strategy, backend):
            if when == "after":
                model.set_attention_backend("_native_math")
            chosen = {m.processor._attention_backend.value for m in model.modules() if isinstance(m, AttentionModuleMixin)}
            assert chosen == {"_native_math"}, chosen
            assert_equal(run_steps(model, inputs), expected, f"attention backend set {when} enable, {strategy}")
            model.set_attention_backend("native")
            assert_equal(run_steps(model, inputs), expected_default, f"default attention backend, {strategy}")


def lora_adapter(strategy: str, backend, verdict: str) -> None:
    from peft import LoraConfig

    expect(verdict, YES)
    def with_adapter():
        model, inputs = build_transformer("flux2")
        torch.manual_seed(0)
        model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights=False))
        return model, inputs

    plain, inputs = build_transformer("flux2")
    model, _ = with_adapter()
    expected = run_steps(model, inputs)
    assert not torch.equal(expected[0], run_steps(plain, inputs, steps=1)[0]), "the adapter changes nothing"
    model, _ = with_adapter()
    with offloaded(model, strategy, backend) as handle:
        assert_equal(run_steps(model, inputs), expected, f"LoRA adapter, {strategy}")
        if strategy == "layerwise":
            streamed = {id(p) for u in handle.parts[0].units for e in u.entries for o in e.owners for p in [o.get()]}
            lora = [p for n, p in model.named_parameters() if "lora_" in n and ".transformer_blocks." in f".{n}"]
            assert lora and all(id(p) in streamed for p in lora), "the adapter's weights are not streamed"


def _check_refused(strategy: str, backend, verdict: str, attach: Callable[[nn.Module], None], match: str,
                   attach_after: Callable[[nn.Module], None] | None = None) -> None:
    expect(verdict, REFUSED)
    model, _ = build_transformer("flux2")
    attach(model)
    before = {name: (p, p.data_ptr(), p.device) for name, p in model.named_parameters()}
    with pytest.raises(offload_core.OffloadConfigError, match=match):
        offload_core.enable_offload(model, backend=backend, **OPTIONS[strategy])
    assert {n: (p, p.data_ptr(), p.device) for n, p in model.named_parameters()} == before, "weights touched"
    assert not any({"_compiled_call_impl", "compile"} & m.__dict__.keys() for m in model.modules())
    if attach_after is not None:  # the method that attaches them, on a model already offloaded
        model, inputs = build_transformer("flux2")
        expected = run_steps(model, inputs, steps=1)
        with offloaded(model, strategy, backend):
            with pytest.raises(offload_core.OffloadConfigError, match="handle.disable"):
                attach_after(model)
            assert_equal(run_steps(model, inputs, steps=1), expected, f"{strategy} after the refused call")
        assert "enable_group_offload" not in model.__dict__, "refusal left after disable"


def _bf16_flux2() -> tuple[nn.Module, dict]:
    model, inputs = build_transformer("flux2")
    to = lambda v: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v  # noqa: E731
    return model.to(torch.bfloat16), {k: to(v) for k, v in inputs.items()}


def _cast(model: nn.Module) -> None:
    model.enable_layerwise_casting(storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.bfloat16)


def _hooks_as_diffusers_left_them(model: nn.Module) -> None:
    from diffusers.hooks.layerwise_casting import LayerwiseCastingHook

    hooks = [h for m in model.modules() for h in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}).values()
             if isinstance(h, LayerwiseCastingHook)]
    assert hooks and all(h.fn_ref.pre_forward == h.pre_forward and h.fn_ref.post_forward == h.post_forward
                         for h in hooks), "the casting hooks are not diffusers' own after disable"
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in model.modules() if isinstance(m, nn.Linear)
               and "layerwise_casting" in getattr(getattr(m, "_diffusers_hook", None), "hooks", {}))


def layerwise_casting(strategy: str, backend, verdict: str) -> None:
    from diffusers.hooks import apply_layerwise_casting

    expect(verdict, YES)
    reference, inputs = _bf16_flux2()
    _cast(reference)
    expected = run_steps(reference, inputs)
    for when in ("before", "after"):
        model, _ = _bf16_flux2()
        if when == "before":
            _cast(model)
        with offloaded(model, strategy, backend) as handle:
            if when == "after":  # one re-pack (across ranks, on every rank at once)
                _cast(model)
            assert_equal(run_steps(model, inputs), expected, f"casting enabled {when} enable, {strategy}")
            if strategy != "distributed":  # the homes (and what is copied from them) hold float8
                assert torch.float8_e4m3fn in {b.dtype for b in _buffers(handle)}, "no home holds float8"
        _hooks_as_diffusers_left_them(model)
        assert_equal(run_steps(model, inputs), expected, f"casting after disable, {strategy}")
    model, _ = _bf16_flux2()
    with offloaded(model, strategy, backend):
        if strategy == "distributed":  # one layer at a time cannot re-pack across ranks: refused, nothing changed
            with pytest.raises(offload_core.OffloadedModelError, match="collective handle.disable"):
                apply_layerwise_casting(model, torch.float8_e4m3fn, torch.bfloat16, skip_modules_pattern="auto")
            assert_equal(run_steps(model, inputs, steps=1), run_steps(_bf16_flux2()[0], inputs, steps=1),
                         "the refused function changed the model")
            return
        apply_layerwise_casting(model, torch.float8_e4m3fn, torch.bfloat16, skip_modules_pattern="auto")
        assert_equal(run_steps(model, inputs), expected, f"apply_layerwise_casting after enable, {strategy}")


def group_offloading(strategy: str, backend, verdict: str) -> None:
    from diffusers.hooks import apply_group_offloading

    def group(m: nn.Module) -> None:
        m.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)

    def function(m: nn.Module) -> None:
        apply_group_offloading(m, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)

    _check_refused(strategy, backend, verdict, group, "group offloading", attach_after=group)
    _check_refused(strategy, backend, verdict, function, "group offloading", attach_after=function)


def accelerate_offload(strategy: str, backend, verdict: str) -> None:
    from accelerate import cpu_offload

    _check_refused(strategy, backend, verdict, lambda m: cpu_offload(m, execution_device=torch.device("cpu")), "accelerate")


# -- training ---------------------------------------------------------------------------------
def _input_leaves(inputs: dict) -> dict:
    return {k: v.clone().requires_grad_(True) if torch.is_tensor(v) and v.is_floating_point() else v
            for k, v in inputs.items()}


def _loss(model: nn.Module, inputs: dict) -> torch.Tensor:
    return first_tensor(model(**inputs)).float().square().mean()


def input_gradients(strategy: str, backend, verdict: str) -> None:
    expect(verdict, YES)
    model, inputs = build_transformer("flux2")
    model.requires_grad_(False)
    reference = copy.deepcopy(model)
    expected = _input_leaves(inputs)
    _loss(reference, expected).backward()
    with offloaded(model, strategy, backend):
        for _ in range(2):
            got = _input_leaves(inputs)
            _loss(model, got).backward()
            for k, v in expected.items():
                if torch.is_tensor(v) and v.grad is not None:
                    assert torch.equal(got[k].grad, v.grad), f"input gradient {k}, {strategy}"


def lora_training(strategy: str, backend, verdict: str) -> None:
    from peft import LoraConfig

    kind = expect(verdict, YES, REFUSED)
    model, inputs = build_transformer("flux2")
    model.requires_grad_(False)
    torch.manual_seed(0)
    model.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q", "to_v"], init_lora_weights="gaussian"))
    reference = copy.deepcopy(model)
    with offloaded(model, strategy, backend):
        if kind == REFUSED:
            with pytest.raises(offload_core.DistributedOffloadError, match="shard_host_weights=False"):
                _loss(model, inputs).backward()
            with torch.no_grad():
                assert torch.equal(first_tensor(model(**inputs)), first_tensor(reference(**inputs)))
            return
        loops = []
        for m in (model, reference):
            params = [p for p in m.parameters() if p.requires_grad]
            loops.append((m, params, torch.optim.AdamW(params, lr=1e-2)))
        for step in range(2):
            for m, _, opt in loops:
                opt.zero_grad()
                _loss(m, inputs).backward()
                opt.step()
            ours, theirs = loops[0][1], loops[1][1]
            assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), f"LoRA weights after step {step}, {strategy}"


CASES: dict[str, Callable] = {
    fn.__name__: fn
    for fn in (
        torchao_int8, torchao_int8_legacy, gguf, quanto_qint8, opaque_subclass,
        first_block_cache, pyramid_attention_broadcast, taylorseer_cache, mag_cache, attention_backend, lora_adapter,
        layerwise_casting, group_offloading, accelerate_offload, input_gradients, lora_training,
    )
}
