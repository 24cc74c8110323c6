"""The contract of docs/design.md ("What you can do to an offloaded model"), points 1, 2, 4, 5 and
10, on layerwise and model-level offload under chaos: every change a user makes to an offloaded
model (state dicts loaded, weights edited in place, tensors replaced, dtype changes, modules
added) behaves exactly as on the same model without offload, which gets the same change; both
are compared with torch.equal after each step and after disable(). The model's forward also
updates buffers (a counter in place, a running mean replaced by a new tensor), which must keep
their values across calls and after disable()."""

from __future__ import annotations

import copy
import io
import pickle

import pytest
import torch
from torch import nn

import offload_core

from contract_models import D, ENABLE_OPTIONS, Scaled, assert_offloaded, assert_same, build, new_state, run
from helpers import chaos_backend

def _strict_failure(m: nn.Module) -> None:
    partial = new_state(m, 4)
    del partial["head.weight"]
    with pytest.raises(RuntimeError, match="Missing key"):
        m.load_state_dict(partial)  # torch copies what matches, then reports what is missing


def _no_grad(fn):
    def op(m):
        with torch.no_grad():
            fn(m)
    return op


#: what a user does between forwards; each is applied alike to the offloaded model and the reference
CHANGES = {
    "load_state_dict": lambda m: m.load_state_dict(new_state(m, 1)),
    "load_state_dict_assign": lambda m: m.load_state_dict(new_state(m, 2), assign=True),
    "load_state_dict_strict_failure": _strict_failure,
    "load_block": lambda m: m.blocks[1].load_state_dict(new_state(m.blocks[1], 3)),
    "load_submodule_not_strict": lambda m: m.blocks[2].layers[1].load_state_dict({"weight": new_state(m.blocks[2].layers[1], 5)["weight"]}, strict=False),
    "inplace_through_parameter": _no_grad(lambda m: m.blocks[0].layers[0].weight.mul_(2)),
    "inplace_through_data": lambda m: m.blocks[3].layers[0].weight.data.add_(0.5),
    "inplace_buffer": lambda m: m.blocks[4].layers[1].running.fill_(0.25),
    "resident_inplace": lambda m: m.embed.weight.data.mul_(3),
    "data_replaced": lambda m: setattr(m.blocks[1].layers[0].weight, "data", torch.full_like(m.blocks[1].layers[0].weight, 0.1)),
    "parameter_replaced": lambda m: setattr(m.blocks[2].layers[0], "weight", nn.Parameter(torch.ones(D, D))),
    "buffer_replaced": lambda m: setattr(m.blocks[0].layers[0], "scale", torch.full((D,), 2.0)),
    "buffer_another_dtype": lambda m: setattr(m.blocks[2].layers[0], "scale", torch.full((D,), 2.0, dtype=torch.float64)),
    "data_another_dtype": lambda m: setattr(m.blocks[1].layers[0].weight, "data", m.blocks[1].layers[0].weight.data.double()),
    "data_transposed": lambda m: setattr(m.blocks[4].layers[0].weight, "data", m.blocks[4].layers[0].weight.data.t()),
    "half": lambda m: m.half(),
    "to_dtype": lambda m: m.to(torch.bfloat16),
    "block_double": lambda m: m.blocks[1].double(),
    "half_then_float": lambda m: m.half().float(),
    "to_own_device": lambda m: m.to(offload_core.get_backend("fake").device()),
    "apply_values": lambda m: m._apply(lambda t: t * 2 if t.is_floating_point() else t),
    "submodule_added": lambda m: setattr(m.blocks[1].layers, "0", Scaled(m.blocks[1].layers[0])),
    "new_buffer": lambda m: m.blocks[3].layers[0].register_buffer("extra", torch.ones(2)),
}


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("change", CHANGES)
def test_a_change_between_forwards_acts_as_without_offload(strategy, change):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    assert torch.equal(run(model, 0), run(reference, 0))
    CHANGES[change](model)
    CHANGES[change](reference)
    for step in (1, 2):
        assert torch.equal(run(model, step), run(reference, step)), f"forward {step} after {change}"
    assert_same(model, reference)  # what the parameters show between forwards is the truth
    assert_offloaded(handle, model)
    for key, value in reference.blocks[3].state_dict().items():  # a block's and a submodule's state dict
        assert torch.equal(model.blocks[3].state_dict()[key], value), key
    assert torch.equal(model.blocks[2].layers[1].state_dict()["running"], reference.blocks[2].layers[1].running)
    handle.disable()
    assert_same(model, reference)
    assert not any(handle.backend.is_pinned(t) for t in model.parameters())
    assert torch.equal(run(model, 3), run(reference, 3))


def test_writes_right_after_a_forward_wait_for_the_copies_that_read_the_host():
    """A forward's copies read the host buffers; a state dict loaded right after it (by a model
    whose forward copies nothing home, so nothing else waits for them) is written after them."""
    from stacks import StackSpec, build_stack

    spec = StackSpec(d=D, layer_dtypes=[[torch.float32, torch.bfloat16]] * 4, transposed=True)
    model, reference = build_stack(spec), build_stack(spec)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    x = torch.randn(3, D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(model(x), reference(x))
        for m in (model, reference):
            m.load_state_dict(new_state(m, 1))
        assert torch.equal(model(x), reference(x))
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_moving_the_weights_elsewhere_is_refused_before_anything_changes(strategy):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    run(model, 0), run(reference, 0)
    with pytest.raises(offload_core.OffloadedModelError, match=r"handle\.disable\(\)"):
        model.to("meta")
    with pytest.raises(offload_core.OffloadedModelError, match=r"handle\.disable\(\)"):
        model.blocks[2].to("meta")
    assert_same(model, reference)
    assert torch.equal(run(model, 1), run(reference, 1))
    handle.disable()
    assert_same(model, reference)


def test_dtype_change_repacks_with_slots_to_fit():
    """A block converted to float64 no longer fits the slots it had: the part re-packs with
    larger slots, and streaming it costs its new size."""
    model = build()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    part = handle.parts[0]
    before = part.slot_bytes
    model.blocks[1].double()
    assert part.slot_bytes > before and torch.float64 in part.slot_shape
    run(model, 0)
    assert handle.stats()["device_peak_bytes"] >= part.device_weight_bytes
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_copies_are_ordinary_models_with_the_true_weights(strategy, tmp_path):
    """copy.deepcopy, pickle and safetensors' save_model of an offloaded model (and deepcopy of one
    block) give what they give without offload; the copies are not offloaded."""
    from safetensors.torch import load_model, save_model

    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    for m in (model, reference):
        run(m, 0)
        m.blocks[1].layers[0].weight.data.mul_(2)
    clone = copy.deepcopy(model)
    pickled = pickle.loads(pickle.dumps(model))
    saved = io.BytesIO()
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    block = copy.deepcopy(model.blocks[1])
    save_model(model, str(tmp_path / "model.safetensors"))
    fresh = build()
    fresh.load_state_dict(model.state_dict())  # non-persistent buffers are not in files
    load_model(fresh, str(tmp_path / "model.safetensors"))
    copies = (clone, pickled, loaded, fresh)
    for copied in copies:
        assert not hasattr(copied, "_offload_core_handle")
        assert not any("forward" in m.__dict__ or "__deepcopy__" in m.__dict__ for m in copied.modules())
        assert_same(copied, reference)
    assert not any("forward" in m.__dict__ for m in block.modules())
    assert torch.equal(block.layers[0].weight, reference.blocks[1].layers[0].weight)
    expected = run(reference, 1)
    for copied in copies:
        assert torch.equal(run(copied, 1), expected)
    assert torch.equal(run(model, 1), expected), "the original still works after being copied"
    handle.disable()
    assert_same(model, reference)


def test_inside_frozen_the_next_forward_loads_early_and_visible_changes_still_count():
    """handle.frozen() (what a pipeline call without step callbacks runs in): the end of a forward
    queues the first blocks of the next; a change the handle can see still reaches the next forward."""
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    part = handle.parts[0]
    with handle.frozen():
        assert torch.equal(run(model, 0), run(reference, 0))
        assert part.ring.occupants == list(range(part.num_slots)), "the next forward's first blocks are queued"
        for m in (model, reference):
            m.blocks[0].layers[0].weight.data = torch.full((D, D), 0.3)
        assert torch.equal(run(model, 1), run(reference, 1))
        assert torch.equal(run(model, 2), run(reference, 2))
    assert not part._queued and part.ring.occupants == [-1] * part.num_slots, "leaving frozen() waits for the copies"
    assert handle.stats()["prefetch_misses"] == 0
    handle.disable()
    assert_same(model, reference)


def test_weights_changed_in_place_by_a_step_callback_count_from_the_next_step():
    """A step callback is user code between steps: a pipeline call with one is not frozen, so an
    in-place write through .data (which the handle cannot see) still reaches the next step."""
    from offload_core.tiny import build_pipeline

    ours, theirs = build_pipeline("flux2"), build_pipeline("flux2")
    backend = chaos_backend()

    def callback(pipe, step, timestep, kwargs):
        backend.synchronize()  # any copy queued early has landed: a stale one would be used next step
        pipe.transformer.transformer_blocks[0].attn.to_q.weight.data.mul_(1.5)
        return kwargs

    handle = offload_core.enable_offload(ours.pipe, enable_layerwise_offload=True, backend=backend)
    assert torch.equal(ours.run(seed=0, callback_on_step_end=callback), theirs.run(seed=0, callback_on_step_end=callback))
    handle.disable()


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_deep_copy_of_an_offloaded_pipeline_is_an_ordinary_pipeline(strategy):
    from offload_core.tiny import build_pipeline

    tiny = build_pipeline("flux2")
    original = type(tiny.pipe)
    expected = tiny.run(seed=0)
    handle = offload_core.enable_offload(tiny.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    clone = copy.deepcopy(tiny)
    assert type(clone.pipe) is original and not hasattr(clone.pipe, "_offload_core_handle")
    assert not any("forward" in m.__dict__ for c in clone.pipe.components.values() if isinstance(c, nn.Module) for m in c.modules())
    assert torch.equal(clone.run(seed=0), expected)
    assert torch.equal(tiny.run(seed=0), expected), "the original still works after being copied"
    offload_core.enable_offload(clone.pipe, enable_cpu_offload=True, backend=chaos_backend()).disable()  # not owned twice
    handle.disable()
