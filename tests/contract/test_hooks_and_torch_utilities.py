"""Other hooks, other torch utilities, serialisation, lifecycle and misuse, each done alike to an
offloaded model and to the same model without offload, under chaos, then compared with torch.equal
(forwards, every tensor, after ``disable()`` too). docs/design.md's contract table lists each case and its outcome."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import offload_core

from contract_models import D, ENABLE_OPTIONS, assert_offloaded, assert_same, build, new_state, run
from helpers import chaos_backend


def _no_grad(fn):
    def op(m):
        with torch.no_grad():
            fn(m)
    return op


def _hook_scaling_output(m):
    m.blocks[2].register_forward_hook(lambda module, args, out: out * 0.5)


def _pre_hook_with_kwargs(m):
    m.blocks[1].register_forward_pre_hook(lambda module, args, kwargs: ((args[0] + 1,), kwargs), with_kwargs=True)


def _post_hook_editing_its_block(m):
    def hook(module, args, out):
        with torch.no_grad():
            module.layers[0].weight.add_(0.01)
    m.blocks[3].register_forward_hook(hook)


def _hook_reading_another_block(m):
    m.blocks[4].register_forward_hook(lambda module, args, out: out + m.blocks[0].layers[0].weight.float().sum())


def _vector_round_trip(m):
    vec = _flat(m)
    g = torch.Generator().manual_seed(7)
    new = torch.randn(vec.shape, generator=g)
    params = list(m.parameters())
    offset = 0
    for p in params:  # as vector_to_parameters: each ``p.data`` assigned a slice of one vector
        n = p.numel()
        p.data = new[offset:offset + n].reshape(p.shape).to(p.dtype)
        offset += n


def _flat(m) -> torch.Tensor:
    """Every parameter's values in one vector (``parameters_to_vector`` needs contiguous ones)."""
    return torch.cat([p.detach().float().reshape(-1) for p in m.parameters()])


def _state_dict_edited_in_place(m):
    with torch.no_grad():
        m.state_dict()["blocks.2.layers.0.weight"].mul_(-1)


def _set_submodule(m):
    g = torch.Generator().manual_seed(3)
    layer = nn.Linear(D, D, bias=False)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(D, D, generator=g))
    m.set_submodule("blocks.1.layers.0", layer)


def _swap_blocks(m):
    m.blocks[0], m.blocks[2] = m.blocks[2], m.blocks[0]


def _apply_init(m):
    g = torch.Generator().manual_seed(11)

    def init(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, generator=g)
    m.apply(init)


def _load_state_dict_unexpected(m):
    state = new_state(m, 8)
    state["not.a.key"] = torch.ones(1)
    m.load_state_dict(state, strict=False)


def _restrided_data(m):
    w = m.blocks[1].layers[0].weight
    w.data = w.data.t().contiguous().t()  # same values and shape, other strides


def _data_of_other_dtype(m):
    w = m.blocks[0].layers[0].weight
    w.data = w.data.to(torch.float64)


def _buffer_set_to_none(m):
    m.blocks[0].layers[0].scale = torch.ones(D)


def _get_parameter_copy(m):
    with torch.no_grad():
        m.get_parameter("blocks.4.layers.0.weight").copy_(torch.eye(D))


def _requires_grad_off(m):
    m.requires_grad_(False)


def _train_eval(m):
    m.train()
    m.eval()


def _type_double(m):
    m.blocks[2].type(torch.float64)


def _bfloat16_block(m):
    m.blocks[4].bfloat16()


def _resident_buffer(m):
    m.embed.register_buffer("offset", torch.zeros(D))


def _named_buffer_in_place(m):
    dict(m.named_buffers())["blocks.3.layers.1.running"].add_(1.0)


def _zero_grad(m):
    m.zero_grad(set_to_none=True)


def _grow_block_list(m):
    m.blocks.append(copy.deepcopy(m.blocks[1]))


def _replace_block(m):
    m.blocks[3] = copy.deepcopy(m.blocks[0])


#: done alike to the offloaded model and the reference between forwards
CASES = {
    "forward_hook_scaling_output": _hook_scaling_output,
    "pre_hook_with_kwargs": _pre_hook_with_kwargs,
    "post_hook_editing_its_block": _post_hook_editing_its_block,
    "hook_reading_another_block": _hook_reading_another_block,
    "data_assigned_from_one_vector": _vector_round_trip,
    "state_dict_tensor_edited_in_place": _state_dict_edited_in_place,
    "set_submodule": _set_submodule,
    "blocks_swapped": _swap_blocks,
    "apply_init": _apply_init,
    "load_state_dict_unexpected_keys": _load_state_dict_unexpected,
    "data_restrided": _restrided_data,
    "data_of_other_dtype": _data_of_other_dtype,
    "buffer_replaced_in_resident_module": _buffer_set_to_none,
    "get_parameter_copy": _no_grad(_get_parameter_copy),
    "requires_grad_off": _requires_grad_off,
    "train_then_eval": _train_eval,
    "type_double_on_a_block": _type_double,
    "bfloat16_on_a_block": _bfloat16_block,
    "buffer_added_to_resident_module": _resident_buffer,
    "named_buffer_in_place": _named_buffer_in_place,
    "zero_grad": _zero_grad,
    "block_list_grown": _grow_block_list,
    "block_replaced": _replace_block,
}


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("case", CASES)
def test_an_adversarial_change_acts_as_without_offload(strategy, case):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    assert torch.equal(run(model, 0), run(reference, 0))
    CASES[case](model)
    CASES[case](reference)
    for step in (1, 2):
        assert torch.equal(run(model, step), run(reference, step)), f"forward {step} after {case}"
    assert_same(model, reference)
    assert_offloaded(handle, model)
    handle.disable()
    assert_same(model, reference)


# -- serialisation and reading ---------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_state_dict_through_torch_save_loads_into_a_model_without_offload(strategy):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    run(model, 0), run(reference, 0)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    fresh = build()
    fresh.load_state_dict(torch.load(io.BytesIO(buffer.getvalue())))
    assert_same(fresh, reference)
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_pickled_block_and_a_deep_copied_block_hold_the_true_weights(strategy):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(4))
    for copied in (pickle.loads(pickle.dumps(model.blocks[1])), copy.deepcopy(model.blocks[1])):
        assert_same(copied, reference.blocks[1])
        with torch.no_grad():
            assert torch.equal(copied(x), copy.deepcopy(reference.blocks[1])(x))
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_keep_vars_state_dict_and_a_flat_vector_read_the_truth(strategy):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    run(model, 0), run(reference, 0)
    ours, theirs = model.state_dict(keep_vars=True), reference.state_dict(keep_vars=True)
    assert all(torch.equal(ours[k].detach(), theirs[k].detach()) for k in theirs)
    assert torch.equal(_flat(model), _flat(reference))
    handle.disable()


# -- calls -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_block_called_on_its_own_between_forwards(strategy):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(model.blocks[2](x), reference.blocks[2](x))
    assert torch.equal(run(model, 1), run(reference, 1))
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_functional_call_with_other_weights_leaves_the_model_as_it_was(strategy):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(6))
    other = {"head.weight": torch.eye(D)}
    with torch.no_grad():
        ours = torch.func.functional_call(model, other, (x,))
        theirs = torch.func.functional_call(reference, other, (x,))
    assert torch.equal(ours, theirs)
    assert torch.equal(run(model, 1), run(reference, 1))
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_forward_under_autocast(strategy):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(run(model, 0), run(reference, 0))
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_raising_forward_hook_then_the_next_forward(strategy):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])

    def boom(module, args, out):
        raise ValueError("hook failed")
    for x in (model, reference):  # blocks 0..2 ran and counted their steps, in both
        hook = x.blocks[2].register_forward_hook(boom)
        with pytest.raises(ValueError, match="hook failed"):
            run(x, 0)
        hook.remove()
    assert torch.equal(run(model, 1), run(reference, 1))
    handle.disable()


# -- lifecycle -------------------------------------------------------------------------------------
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_enable_disable_enable_with_the_other_strategy(strategy):
    model, reference = build(), build()
    other = "model" if strategy == "layerwise" else "layerwise"
    for name in (strategy, other):
        handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[name])
        assert torch.equal(run(model, 0), run(reference, 0))
        handle.disable()
        handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_moving_to_another_device_is_refused_and_changes_nothing(strategy):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    with pytest.raises(offload_core.OffloadedModelError, match=r"handle.disable\(\)"):
        model.to("meta")
    assert torch.equal(run(model, 0), run(reference, 0))
    handle.disable()
    assert_same(model, reference)
