"""Weight edits at moments a strategy might not see, inference mode, ``_apply``, copies and saves,
the lifetime of a model dropped without ``disable()``, and its structure changed (docs/design.md,
"What you can do to an offloaded model", rows 11 to 18). Each is applied
alike to an offloaded model and to the same model without offload and compared with
torch.equal, or must raise a clear error that names the fix and leave the model usable."""

from __future__ import annotations

import copy
import gc
import io
import weakref

import pytest
import torch
from torch import nn

import offload_core
from offload_core.base.errors import OffloadedModelError
from offload_core.tiny import build_pipeline

from contract_models import D, ENABLE_OPTIONS, assert_offloaded, assert_same, build, run
from helpers import chaos_backend
from offload_core_fake import UnseenWriteError
from stacks import Block, Layer, Stack


def _enable(model, strategy, **options):
    return offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy], **options)


def _same_forwards(model, reference, steps=(0, 1)) -> None:
    for step in steps:
        assert torch.equal(run(model, step), run(reference, step)), f"forward {step}"


# -- weight edits at moments the strategy might not see ------------------------------------------
def _scale_in_place(x):
    with torch.no_grad():
        x.blocks[1].layers[0].weight.mul_(1.5)


def _scale_through_data(x):
    x.blocks[1].layers[0].weight.data.mul_(1.5)


def _assign_data(x):
    w = x.blocks[1].layers[0].weight
    w.data = w.data * 1.5


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("edit", [_scale_in_place, _scale_through_data, _assign_data], ids=lambda f: f.__name__[1:])
def test_a_model_pre_hook_that_edits_a_block_weight_is_seen(strategy, edit):
    """The pass begins (layerwise: the first blocks are queued) before the model's own pre-hooks
    run: the block's copy must be checked against the host where it is used."""
    if strategy == "model" and edit is _scale_through_data:
        pytest.skip("model-level swaps the model in before its pre-hooks: see the sanitizer's test below")
    model, reference = build(), build()
    handle = _enable(model, strategy)
    for x in (model, reference):
        x.register_forward_pre_hook(lambda module, args: edit(module))
    _same_forwards(model, reference)
    assert_same(model, reference)
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_block_hook_that_gives_the_next_block_new_data_is_seen(strategy):
    """Between two blocks of one pass: block 1's load is queued as block 0 starts, before block
    0's forward hook gives block 1's weight new data, so each block is checked again as it binds.
    (An in-place write there races with that load: row 11's limit, which the sanitizer reports.)"""
    model, reference = build(), build()
    handle = _enable(model, strategy)
    for x in (model, reference):
        x.blocks[0].register_forward_hook(lambda module, args, output, x=x: _assign_data(x))
    _same_forwards(model, reference)
    assert_same(model, reference)
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_block_hook_giving_the_next_block_data_of_another_layout_is_computed_with_then_repacked(strategy):
    """A structural change in the middle of a pass cannot be packed around (the pass's blocks are
    bound): layerwise runs the block on a device copy of the new data for that call, gives the
    weight that data back after it, and packs the block again before the next call."""
    model, reference = build(), build()
    handle = _enable(model, strategy)
    hooks = [x.blocks[0].register_forward_hook(lambda module, args, output, x=x: _transpose_data(x))
             for x in (model, reference)]
    _same_forwards(model, reference, steps=(0,))
    for hook in hooks:
        hook.remove()
    _assert_same_layouts(model, reference)
    _same_forwards(model, reference, steps=(1, 2))
    _assert_same_before_and_after_disable(model, reference, handle)


def test_a_block_hook_giving_the_next_block_data_of_another_shape_fails_as_without_offload():
    """Data the layer cannot compute with fails as it does without offload (torch's own error),
    and the model stays usable: given data of its shape again, it computes as the reference."""
    model, reference = build(), build()
    handle = _enable(model, "layerwise")
    grown = torch.ones(D, 2 * D)

    def widen(x) -> None:
        x.blocks[1].layers[0].weight.data = grown.to(x.blocks[1].layers[0].weight.dtype)

    errors = []
    for x in (model, reference):
        hook = x.blocks[0].register_forward_hook(lambda module, args, output, x=x: widen(x))
        with pytest.raises(RuntimeError) as raised:
            run(x, 0)
        errors.append(str(raised.value))
        hook.remove()
    assert errors[0] == errors[1]
    for x in (model, reference):
        x.blocks[1].layers[0].weight.data = torch.zeros(D, D, dtype=x.blocks[1].layers[0].weight.dtype)
    _same_forwards(model, reference)
    handle.disable()
    assert_same(model, reference)


class DataAssigning(nn.Module):
    """A layer whose forward gives its weight new data (a quantiser's fake-quant step, say)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        w = self.inner.weight
        w.data = (w.data * 0.5).to(w.dtype)
        return self.inner(x)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_forward_that_assigns_weight_data_is_kept(strategy):
    model, reference = build(), build()
    for x in (model, reference):
        x.blocks[1].layers[0] = DataAssigning(x.blocks[1].layers[0])
    handle = _enable(model, strategy)
    _same_forwards(model, reference, steps=(0, 1, 2))
    assert_same(model, reference)
    handle.disable()
    assert_same(model, reference)


class DataRetyping(nn.Module):
    """A layer whose forward gives its weight data of another dtype (an upcast on first use): no
    home view can take it, so the parameter keeps that data and its block is packed again."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        w = self.inner.weight
        if w.dtype != torch.float64:
            w.data = w.data.to(torch.float64)
        return self.inner(x)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_forward_that_gives_weight_data_of_another_dtype_is_kept(strategy):
    model, reference = build(), build()
    for x in (model, reference):
        x.blocks[1].layers[0] = DataRetyping(x.blocks[1].layers[0])
    handle = _enable(model, strategy)
    _same_forwards(model, reference, steps=(0, 1, 2))
    assert_same(model, reference)
    handle.disable()
    assert_same(model, reference)


def _transpose_data(x):
    """The weight's own memory in another layout: its address does not change, what it computes does."""
    w = x.blocks[1].layers[0].weight
    w.data = w.data.t()


def _assert_same_layouts(model, reference) -> None:
    ours = dict(model.named_parameters())
    for name, value in reference.named_parameters():
        assert (ours[name].shape, ours[name].stride()) == (value.shape, value.stride()), name


def _assert_same_before_and_after_disable(model, reference, handle) -> None:
    """Values and layouts equal the reference's while offloaded and once ``disable()`` restored them."""
    for disable in (False, True):
        if disable:
            handle.disable()
        _assert_same_layouts(model, reference)
        assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_weight_given_its_own_memory_in_another_layout_between_calls_is_seen(strategy):
    """``p.data = p.data.t()`` keeps the parameter's address: a check of addresses alone let the
    next forward compute with the old layout. The block is packed again, in the new layout."""
    model, reference = build(), build()
    handle = _enable(model, strategy)
    _same_forwards(model, reference, steps=(0,))
    for x in (model, reference):
        _transpose_data(x)
    _same_forwards(model, reference, steps=(1, 2))
    _assert_same_before_and_after_disable(model, reference, handle)


class DataTransposing(nn.Module):
    """A layer whose forward shows its weight's memory in another layout (square: same shape)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        w = self.inner.weight
        w.data = w.data.t()
        return self.inner(x)


class DiagonalKeeping(nn.Module):
    """A layer whose forward replaces a buffer by a view of its weight in another layout (the
    diagonal: stride ``d + 1``, where the buffer's is 1), read by the next forward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.register_buffer("diagonal", torch.zeros(D, dtype=inner.weight.dtype))

    def forward(self, x):
        y = self.inner(x) + self.diagonal.to(x.dtype)
        self.diagonal = self.inner.weight.detach().diagonal()
        return y


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("layer", [DataTransposing, DiagonalKeeping], ids=["weight", "buffer"])
def test_a_forward_that_leaves_a_tensor_in_another_layout_is_kept(strategy, layer):
    """The layout a forward leaves a weight in (or a buffer it replaces by a view of a weight) is
    the truth, as a value is: a copy into the home's layout would compute otherwise next time, and
    the view itself reads device memory that the next block's load overwrites. It is kept as a host
    copy of its own (no slot is left to it, nothing stays on the device) and the block packed
    again."""
    model, reference = build(), build()
    for x in (model, reference):
        x.blocks[1].layers[0] = layer(x.blocks[1].layers[0])
    handle = _enable(model, strategy)
    _same_forwards(model, reference, steps=(0, 1, 2))
    assert handle.stats()["retired_slot_bytes"] == 0, "the kept tensor still viewed device memory"
    _assert_same_before_and_after_disable(model, reference, handle)


class DataEditing(nn.Module):
    """A layer whose forward edits its weight in place through ``.data`` (no version counter moves)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x):
        self.inner.weight.data.mul_(0.5)
        return self.inner(x)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_an_in_place_write_through_data_into_device_weights_is_reported_by_the_sanitizer(strategy):
    """No version counter shows it and it would be lost: under ``pytest --backend=fake`` the race
    sanitizer reports it where it happens, naming the fix; the model stays usable."""
    model, reference = build(), build()
    layer = model.blocks[1].layers[0]
    model.blocks[1].layers[0] = DataEditing(layer)
    handle = _enable(model, strategy)
    with pytest.raises(UnseenWriteError, match=r"(?s)through `.data`.*fix: write through the parameter itself"):
        run(model, 0)
    model.blocks[1].layers[0] = layer  # the model keeps working once the forward is fixed
    run(model, 1)
    handle.disable()
    for name, value in reference.named_parameters():  # the unseen write went nowhere
        assert torch.equal(model.get_parameter(name), value), name


# -- inference mode ------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_enable_and_repack_inside_inference_mode_build_ordinary_tensors(strategy):
    model, reference = build(), build()
    with torch.inference_mode():
        handle = _enable(model, strategy)
    _same_forwards(model, reference)
    for x in (model, reference):  # a structural change: the next forward re-packs, inside inference_mode
        x.blocks[3].layers[0].register_buffer("extra", torch.ones(2))
    with torch.inference_mode():
        assert torch.equal(model(torch.ones(3, 8)), reference(torch.ones(3, 8)))
    _same_forwards(model, reference, steps=(2,))
    assert not any(p.is_inference() for p in model.parameters())
    with torch.inference_mode():
        handle.disable()
    assert not handle.enabled
    assert not any(p.is_inference() for p in model.parameters())
    assert_same(model, reference)


# -- _apply with functions stand-ins cannot read -------------------------------------------------
APPLIED = {
    "in_place": lambda t: t.mul_(2) if t.is_floating_point() else t,
    "value_dependent": lambda t: t - t.mean() if t.is_floating_point() and t.numel() > 1 else t,
}


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("fn", APPLIED)
def test_apply_with_an_in_place_or_value_dependent_function_acts_as_without_offload(strategy, fn):
    model, reference = build(), build()
    handle = _enable(model, strategy)
    for x in (model, reference):
        x._apply(APPLIED[fn])
    _same_forwards(model, reference)
    assert_same(model, reference)
    assert_offloaded(handle, model)
    handle.disable()
    assert_same(model, reference)


# -- copies and saves ----------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_copy_copy_is_a_shallow_copy_as_without_offload(strategy):
    model, reference = build(), build()
    handle = _enable(model, strategy)
    shallow = copy.copy(model)
    assert shallow is not model and shallow.blocks is model.blocks and shallow.embed.weight is model.embed.weight
    assert torch.equal(run(shallow, 0), run(copy.copy(reference), 0))
    _same_forwards(model, reference, steps=(1,))  # the copy's forward ran the same blocks: same state
    handle.disable()
    assert_same(model, reference)


def _saved_bytes(tensors: dict) -> int:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return len(buffer.getvalue())


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_saving_detached_tensors_writes_only_their_bytes(strategy):
    model, reference = build(), build()
    handle = _enable(model, strategy)
    picks = ("embed.bias", "blocks.0.layers.0.weight", "blocks.2.layers.1.weight")
    ours = {n: p.detach() for n, p in model.named_parameters() if n in picks}
    theirs = {n: p.detach() for n, p in reference.named_parameters() if n in picks}
    assert _saved_bytes(ours) == _saved_bytes(theirs)
    buffer = io.BytesIO()
    torch.save(ours, buffer)
    loaded = torch.load(io.BytesIO(buffer.getvalue()))
    assert all(torch.equal(loaded[n], theirs[n]) for n in picks)
    handle.disable()


# -- lifetime ------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("options", [{}, {"pinned_memory": 0}], ids=["pinned", "staged"])
def test_a_model_dropped_without_disable_frees_its_memory(strategy, options):
    backend = chaos_backend()
    model = build()
    handle = offload_core.enable_offload(model, backend=backend, **ENABLE_OPTIONS[strategy], **options)
    run(model, 0)
    assert backend.pinned_memory_allocated() > 0 or options
    gone = weakref.ref(model)
    del model, handle
    gc.collect()
    assert gone() is None
    assert backend.memory_allocated() == 0
    assert backend.pinned_memory_allocated() == 0


# -- pipelines -----------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_pipeline_dropped_without_disable_frees_its_memory(strategy):
    backend = chaos_backend()
    tiny = build_pipeline("flux2")
    handle = offload_core.enable_offload(tiny.pipe, backend=backend, **ENABLE_OPTIONS[strategy])
    tiny.run()
    gone = weakref.ref(tiny.pipe)
    del tiny, handle
    gc.collect()
    assert gone() is None
    assert backend.memory_allocated() == 0
    assert backend.pinned_memory_allocated() == 0


# -- structure and lifecycle ---------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_shortened_block_list_is_found_again(strategy):
    model, reference = build(), build()
    handle = _enable(model, strategy)
    assert torch.equal(run(model, 0), run(reference, 0))
    for x in (model, reference):
        x.blocks = x.blocks[:3]
    _same_forwards(model, reference, steps=(1, 2))
    assert_offloaded(handle, model)
    if strategy == "layerwise":
        assert handle.describe()[0]["streamed_blocks"] == ["blocks.0", "blocks.1", "blocks.2"]
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("strict", [False, True], ids=["non_strict", "strict"])
def test_torch_export_is_refused_naming_disable(strategy, strict):
    model, reference = build(), build()
    handle = _enable(model, strategy)
    with pytest.raises(Exception, match=r"torch.export cannot trace Reuse while it is offloaded.*handle.disable\(\)"):
        torch.export.export(model, (torch.randn(3, 8),), strict=strict)
    _same_forwards(model, reference)
    handle.disable()
    exported = torch.export.export(model, (torch.randn(3, 8),))  # the fix the message names
    assert exported is not None


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_closing_the_fake_backend_while_enabled_does_not_hang(strategy):
    model, reference = build(), build()
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, backend=backend, **ENABLE_OPTIONS[strategy])
    assert torch.equal(run(model, 0), run(reference, 0))
    backend.close()
    _same_forwards(model, reference, steps=(1, 2))
    handle.disable()
    assert_same(model, reference)


def _plain_stack() -> nn.Module:
    """Blocks whose forward changes nothing (a block on disk refuses buffer changes)."""
    g = torch.Generator().manual_seed(0)
    return Stack(8, [Block([Layer(8, torch.float32, i == 1, g)]) for i in range(3)], g).eval()


#: writes into a disk block's tensors outside its forward, by where they go through
_WRITES = {
    "mul_": lambda t: t.mul_(2),
    "data.mul_": lambda t: t.data.mul_(2),
    "add_": lambda t: t.add_(1),
    "iadd": lambda t: t.__iadd__(1),
    "copy_": lambda t: t.copy_(torch.ones_like(t)),
    "zero_": lambda t: t.zero_(),
    "data.fill_": lambda t: t.data.fill_(2.0),
    "setitem": lambda t: t.__setitem__(0, 1.0),
    "init_constant": lambda t: nn.init.constant_(t, 0.5),
    "init_normal": lambda t: nn.init.normal_(t, generator=torch.Generator().manual_seed(0)),
    "out=": lambda t: torch.add(torch.ones_like(t), 1, out=t),
}


def _on_disk(tmp_path):
    model, reference = _plain_stack(), _plain_stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         host_memory=0, offload_folder=tmp_path)
    return model, reference, handle, torch.randn(2, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("tensor", ["weight", "scale"])
@pytest.mark.parametrize("write", _WRITES)
def test_a_write_into_a_disk_placeholder_is_refused(tmp_path, write, tensor):
    model, reference, handle, x = _on_disk(tmp_path)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        layer = model.blocks[1].layers[0]
        assert isinstance(layer.weight, nn.Parameter)
        with pytest.raises(OffloadedModelError, match=r"home on disk.*nowhere to go.*handle.disable\(\)"):
            _WRITES[write](getattr(layer, tensor))
        assert layer.weight.isnan().all() and layer.scale.isnan().all()
        assert torch.equal(model(x), reference(x))
        assert torch.equal(model(x), reference(x))
    handle.disable()
    assert type(layer.weight) is nn.Parameter and type(layer.scale) is torch.Tensor
    assert_same(model, reference)
    with torch.no_grad():  # an ordinary model again: writes go through
        _WRITES[write](layer.weight), _WRITES[write](reference.blocks[1].layers[0].weight)
    assert_same(model, reference)


def test_a_copy_or_a_save_of_a_disk_placeholder_is_an_ordinary_tensor(tmp_path):
    """``copy.deepcopy`` and ``torch.save`` of a placeholder give a plain Parameter or tensor (NaN),
    loadable with ``weights_only=True``: the refusing class stays with the model. A copy is
    writable (a saved one keeps the placeholder's strides, as torch saves any view)."""
    model, _, handle, _ = _on_disk(tmp_path)
    layer = model.blocks[1].layers[0]
    for tensor, kind in ((layer.weight, nn.Parameter), (layer.scale, torch.Tensor)):
        saved = io.BytesIO()
        torch.save(tensor, saved)
        saved.seek(0)
        copied = copy.deepcopy(tensor)
        for plain in (copied, torch.load(saved, weights_only=True)):
            assert type(plain) is kind and plain.shape == tensor.shape and plain.isnan().all()
        copied.data.mul_(2)
    handle.disable()


def test_a_write_around_the_refusal_is_undone_where_the_block_is_next_used(tmp_path):
    """A write that does not go through the placeholder (its ``detach()``) lands in the element
    every placeholder of the block shares: the next forward puts the poison back and raises."""
    model, reference, handle, x = _on_disk(tmp_path)
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        weight = model.blocks[1].layers[0].weight
        weight.detach().zero_()
        with pytest.raises(OffloadedModelError, match=r"home on disk.*was undone.*handle.disable\(\)"):
            model(x)
        assert weight.isnan().all() and model.blocks[1].layers[0].scale.isnan().all()
        assert torch.equal(model(x), reference(x))
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_saving_a_lora_by_its_detached_tensors_writes_the_lora_only(strategy):
    pytest.importorskip("peft")
    from contract_models import lora_state_dict

    ours, theirs = build_pipeline("flux2"), build_pipeline("flux2")
    for tiny in (ours, theirs):
        tiny.pipe.load_lora_weights(lora_state_dict(theirs.pipe.transformer, 1), adapter_name="first")
    handle = offload_core.enable_offload(ours.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])

    def lora(pipe):
        return {n: p.detach() for n, p in pipe.transformer.named_parameters() if "lora_" in n}
    assert _saved_bytes(lora(ours.pipe)) == _saved_bytes(lora(theirs.pipe))
    handle.disable()


# -- distributed, on two gloo ranks --------------------------------------------------------------
def _distributed_cases(rank: int, port: int, shard: bool) -> None:
    from two_ranks import four_blocks, join_ranks, run_step

    backend = join_ranks(rank, port)
    options = {"enable_distributed_layerwise_offload": True, "backend": backend, "shard_host_weights": shard}
    model, reference = four_blocks(), four_blocks()
    with torch.inference_mode():  # row 12
        handle = offload_core.enable_offload(model, **options)
    assert torch.equal(run_step(model, 0), run_step(reference, 0))
    assert not any(p.is_inference() for p in model.parameters())
    shallow = copy.copy(model)  # row 14
    assert shallow.blocks is model.blocks and torch.equal(run_step(shallow, 1), run_step(reference, 1))
    with pytest.raises(OffloadedModelError, match=r"handle.disable\(\)"):  # row 13: refused across ranks
        model._apply(lambda t: t.mul_(2))
    with pytest.raises(Exception, match=r"torch.export cannot trace .*handle.disable\(\)"):  # row 17
        torch.export.export(model, (torch.randn(3, 8),))
    if not shard:  # row 11 and 14: a replicated rank holds the whole host copy
        for x in (model, reference):
            weight = x.blocks[1].layers[0].weight
            x.register_forward_pre_hook(lambda module, args, w=weight: setattr(w, "data", w.data * 1.5))
        assert torch.equal(run_step(model, 2), run_step(reference, 2))
        picks = ("blocks.0.layers.0.weight", "embed.bias")
        assert _saved_bytes({n: p.detach() for n, p in model.named_parameters() if n in picks}) == _saved_bytes(
            {n: p.detach() for n, p in reference.named_parameters() if n in picks})
    assert torch.equal(run_step(model, 3), run_step(reference, 3))
    del model, handle, shallow  # row 15: dropped without disable() on every rank
    gc.collect()
    assert backend.memory_allocated() == 0 and backend.pinned_memory_allocated() == 0


@pytest.mark.parametrize("shard", [False, True], ids=["replicated", "sharded"])
def test_issue_20_cases_across_ranks(shard):
    from two_ranks import spawn_bounded

    spawn_bounded(_distributed_cases, shard)
