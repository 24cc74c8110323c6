"""Contract point 8 (docs/design.md): after an exception inside enable, a forward or disable
(out of memory, Ctrl-C, a raising hook), the handle is in its documented state: an enable left the
model as it was; after a forward the next forward works; an interrupted disable() can be called
again and completes, restoring the exact weights. Checked against the same model without offload,
which gets the same failure."""

from __future__ import annotations

import gc

import pytest
import torch

import offload_core
from offload_core.tiny import build_pipeline
from offload_core.weights import WeightUnit
from offload_core.weights.unit import Region

from contract_models import ENABLE_OPTIONS, assert_same, build, raise_once, run
from helpers import assert_same_state, chaos_backend, snapshot


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("error", [RuntimeError("a raising hook"), KeyboardInterrupt()], ids=["hook", "ctrl-c"])
def test_after_a_failed_forward_the_next_forward_is_exact(strategy, error):
    model, reference = build(), build()
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    for m in (model, reference):
        run(m, 0)
        # inside block 2's forward: blocks 0 and 1 have run (and updated their buffers)
        m.blocks[2].layers[1].register_forward_pre_hook(raise_once(error))
        with pytest.raises(type(error)):
            run(m, 1)
    for step in (2, 3):
        assert torch.equal(run(model, step), run(reference, step))
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_ctrl_c_during_a_pipeline_call_leaves_the_pipeline_working(strategy):
    tiny = build_pipeline("flux2")
    expected = tiny.run(seed=0)
    before = snapshot(tiny.pipe.transformer)
    handle = offload_core.enable_offload(tiny.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    tiny.pipe.transformer.transformer_blocks[1].register_forward_pre_hook(raise_once(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        tiny.run(seed=0)
    assert torch.equal(tiny.run(seed=0), expected)
    handle.disable()
    assert_same_state(before, snapshot(tiny.pipe.transformer))


def test_model_level_out_of_memory_during_a_load_does_not_break_later_calls():
    model, reference = build(), build()
    probe = offload_core.enable_offload(model, enable_cpu_offload=True, backend=chaos_backend())
    nbytes = probe.describe()[0]["host_bytes"]  # the packed model: what one call copies in
    probe.disable()
    backend = chaos_backend(device_memory=nbytes + 64)
    handle = offload_core.enable_offload(model, enable_cpu_offload=True, backend=backend)
    assert torch.equal(run(model, 0), run(reference, 0))
    blocker = backend.empty_device(128, torch.uint8)  # someone else holds a little of the device
    with pytest.raises(torch.OutOfMemoryError):
        run(model, 1)
    del blocker
    gc.collect()
    for step in (1, 2):  # the failed call never ran: the reference skips it too
        assert torch.equal(run(model, step), run(reference, step))
    handle.disable()
    assert_same(model, reference)


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_ctrl_c_during_enable_leaves_the_model_untouched(strategy, monkeypatch):
    model = build()
    before = snapshot(model)
    backend = chaos_backend()
    fill = Region.fill  # copies one storage span into its home: some owners are re-pointed, some not
    calls = {"n": 0, "stop": None}

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == calls["stop"]:
            raise KeyboardInterrupt
        return fill(self, *args, **kwargs)

    monkeypatch.setattr(Region, "fill", interrupted)
    offload_core.enable_offload(model, backend=backend, **ENABLE_OPTIONS[strategy]).disable()
    assert calls["n"] >= 2, "enable copies too few regions to be interrupted half way"
    calls.update(n=0, stop=(calls["n"] + 1) // 2 + 1)  # Ctrl-C half way through packing the weights
    gc.collect()
    with pytest.raises(KeyboardInterrupt):
        offload_core.enable_offload(model, backend=backend, **ENABLE_OPTIONS[strategy])
    assert_same_state(before, snapshot(model))
    assert all("forward" not in m.__dict__ for m in model.modules())
    gc.collect()
    assert backend.memory_allocated() == 0 and backend.pinned_memory_allocated() == 0
    monkeypatch.setattr(Region, "fill", fill)
    handle = offload_core.enable_offload(model, backend=backend, **ENABLE_OPTIONS[strategy])
    handle.disable()
    assert_same_state(before, snapshot(model))


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_an_interrupted_disable_can_be_called_again(strategy, monkeypatch):
    tiny = build_pipeline("flux2")
    expected = tiny.run(seed=0)
    before = {name: snapshot(module) for name, module in tiny.pipe.components.items() if isinstance(module, torch.nn.Module)}
    handle = offload_core.enable_offload(tiny.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    assert torch.equal(tiny.run(seed=0), expected)
    unpack = WeightUnit.unpack
    calls = {"n": 0}

    def interrupted(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt  # Ctrl-C half-way through giving the weights back
        return unpack(self, *args, **kwargs)

    monkeypatch.setattr(WeightUnit, "unpack", interrupted)
    with pytest.raises(KeyboardInterrupt):
        handle.disable()
    assert handle.enabled
    with pytest.raises(offload_core.AlreadyEnabledError, match="again"):
        offload_core.enable_offload(tiny.pipe, enable_cpu_offload=True, backend=chaos_backend())
    handle.disable()
    assert not handle.enabled
    for name, module in tiny.pipe.components.items():
        if isinstance(module, torch.nn.Module):
            assert_same_state(before[name], snapshot(module))
    assert torch.equal(tiny.run(seed=0), expected)
    again = offload_core.enable_offload(tiny.pipe, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])
    assert torch.equal(tiny.run(seed=0), expected)
    again.disable()


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_disable_from_a_step_callback_finishes_the_call_without_offload(strategy):
    """disable() in the middle of a pipeline call (components on the device) gives every tensor
    back and frees the device; the rest of the call runs on the ordinary model."""
    tiny = build_pipeline("flux2")
    expected = tiny.run(seed=0)
    backend = chaos_backend()
    handle = offload_core.enable_offload(tiny.pipe, backend=backend, **ENABLE_OPTIONS[strategy])

    def disable(pipe, step, timestep, kwargs):
        handle.disable()
        return kwargs

    assert torch.equal(tiny.run(seed=0, callback_on_step_end=disable), expected)
    assert not handle.enabled
    gc.collect()
    assert backend.memory_allocated() == 0, "device buffers still referenced after disable"
    modules = [m for m in tiny.pipe.components.values() if isinstance(m, torch.nn.Module)]
    assert not any(backend.is_pinned(t) for m in modules for t in [*m.parameters(), *m.buffers()])
    assert torch.equal(tiny.run(seed=0), expected)


def test_a_component_child_called_alone_leaves_the_device_after_it():
    """pipe.vae.decode(...) outside a pipeline call (a child of the component, not its own call):
    the group goes home afterwards, so an edit made then reaches the next call."""
    tiny = build_pipeline("flux2")
    backend = chaos_backend()
    handle = offload_core.enable_offload(tiny.pipe, enable_cpu_offload=True, backend=backend)
    vae = tiny.pipe.vae
    latents = torch.randn(1, vae.config.latent_channels, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = vae.decode(latents).sample
    gc.collect()
    assert backend.memory_allocated() == 0, "the group stayed on the device"
    vae.decoder.conv_out.weight.data.mul_(2)  # an edit between calls: to the host, the truth
    with torch.no_grad():
        after = vae.decode(latents).sample
    assert not torch.equal(before, after)
    handle.disable()
    with torch.no_grad():
        assert torch.equal(vae.decode(latents).sample, after)
