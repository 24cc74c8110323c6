"""Other libraries' placement-managing hooks attached to a model after ``enable_offload``
(docs/design.md, row 16; offload_core/interop/other_hooks.py): diffusers' functional
``apply_group_offloading``, its model method, accelerate's ``cpu_offload`` and
``add_hook_to_module`` are refused as they attach, with an ``OffloadConfigError`` naming the hook
and ``handle.disable()``, before any weight changes: the model's tensors are the same objects with
the same values, its output equals the same model's without offload, and after ``disable()`` the
hook attaches as without offload. A hook that leaves the weights alone still attaches, and
diffusers' layerwise casting runs exactly (tests/compat/test_layerwise_casting.py)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import offload_core
from offload_core.base.errors import OffloadConfigError

from contract_models import ENABLE_OPTIONS
from denoisers import build_transformer
from helpers import assert_same_state, chaos_backend, forward, snapshot


def _casting(model):
    from diffusers.hooks import apply_layerwise_casting

    apply_layerwise_casting(model, storage_dtype=torch.float8_e4m3fn, compute_dtype=torch.float32)


def _group_offloading(model):
    from diffusers.hooks import apply_group_offloading

    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)


def _group_offloading_leaves(model):
    from diffusers.hooks import apply_group_offloading

    apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="leaf_level")


def _group_offload_method(model):
    model.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)


def _accelerate_cpu_offload(model):
    from accelerate import cpu_offload

    cpu_offload(model, execution_device=torch.device("cpu"))


def _accelerate_hook_on_a_block(model):
    from accelerate.hooks import AlignDevicesHook, add_hook_to_module

    add_hook_to_module(model.transformer_blocks[0], AlignDevicesHook(execution_device=torch.device("cpu"), offload=True))


ATTACH = {
    "apply_group_offloading": (_group_offloading, "group offloading"),
    "apply_group_offloading_leaf_level": (_group_offloading_leaves, "group offloading"),
    "enable_group_offload": (_group_offload_method, "group offloading"),
    "accelerate_cpu_offload": (_accelerate_cpu_offload, "accelerate"),
    "accelerate_add_hook_to_module": (_accelerate_hook_on_a_block, "accelerate"),
}


def _remove_hooks(model):
    """What a user does after the refusal: take away whatever the library left on the model."""
    from accelerate.hooks import remove_hook_from_submodules

    remove_hook_from_submodules(model)
    for module in model.modules():
        module.__dict__.pop("_diffusers_hook", None)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("case", ATTACH)
def test_a_weight_managing_hook_attached_after_enable_is_refused_before_any_weight_changes(strategy, case):
    attach, name = ATTACH[case]
    model, inputs = build_transformer("flux2")
    reference, _ = build_transformer("flux2")
    expected = forward(reference, inputs)
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    assert torch.equal(forward(model, inputs), expected)
    before = snapshot(model)
    with pytest.raises(OffloadConfigError, match=rf"{name}.*handle\.disable\(\)"):
        attach(model)
    assert_same_state(before, snapshot(model))
    assert torch.equal(forward(model, inputs), expected), "the output after the refusal"
    _remove_hooks(model)
    assert torch.equal(forward(model, inputs), expected), "the output once the hook is removed"
    handle.disable()
    attach(reference)  # attached as without offload once disabled
    attach(model)
    assert torch.equal(forward(model, inputs), forward(reference, inputs)), "the hook's own output after disable()"


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_a_pipeline_component_takes_casting_and_hooks_that_leave_the_weights_alone(strategy):
    from diffusers.hooks import HookRegistry, ModelHook

    from offload_core.tiny import build_pipeline

    ours, theirs = build_pipeline("flux2"), build_pipeline("flux2")
    handle = offload_core.enable_offload(ours.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    for tiny in (ours, theirs):  # casting, and a hook that leaves the weights alone, attach as without offload
        _casting(tiny.pipe.transformer)
        HookRegistry.check_if_exists_or_initialize(tiny.pipe.transformer).register_hook(ModelHook(), "user_hook")
    assert torch.equal(ours.run(), theirs.run())
    handle.disable()


def test_a_library_imported_after_enable_is_guarded_as_it_is_imported():
    """A plain torch model offloaded before diffusers' hooks were imported (enable does not import
    them: seconds it should not cost): their registration is guarded as they are imported."""
    code = textwrap.dedent("""
        import sys
        import torch
        import offload_core
        from offload_core.base.errors import OffloadConfigError
        from stacks import StackSpec, build_stack

        model = build_stack(StackSpec(d=8))
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend="fake")
        assert "diffusers.hooks.hooks" not in sys.modules, "enable imported diffusers' hooks"
        weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        from diffusers.hooks import apply_group_offloading
        try:
            apply_group_offloading(model, onload_device=torch.device("cpu"), offload_type="leaf_level")
        except OffloadConfigError as error:
            assert "group offloading" in str(error), error
        else:
            raise AssertionError("group offloading was attached to an offloaded model")
        assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters()), "weights changed"
        handle.disable()
        print("refused")
    """)
    tests = __file__.rsplit("/", 2)[0]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                            env={**__import__("os").environ, "PYTHONPATH": tests})
    assert result.returncode == 0 and "refused" in result.stdout, result.stderr[-3000:]
