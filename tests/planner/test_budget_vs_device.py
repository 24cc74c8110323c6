"""A device budget against the device it runs on (a fake whose capacity is capped, so that
``mem_get_info`` is exact): a budget above the free memory is clamped to it with a warning naming
both figures, the output stays exact and the device peak within the free memory; a device that
fills anyway during enable is an out-of-memory error naming the budget, with the pipeline as it
was; ``offload-core plan --backend`` checks its budget the same way."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import offload_core
from offload_core.cli import main
from offload_core.tiny import build_pipeline

from helpers import chaos_backend, pipeline_reference

pytestmark = pytest.mark.fake_only("the fake's device capacity is capped")

CAPACITY = 3 * 2**20  # flux2-deep holds 5.5 MiB of weights: it must stream


def clamped(asked: str, free: str, total: str, asked_bytes: int, free_bytes: int) -> str:
    return (f"device_memory={asked} ({asked_bytes} bytes) is more than the device's usable memory, {free} "
            f"({free_bytes} bytes) free of {total}: the plan uses {free}; give at most that to plan for it exactly")


def test_a_budget_above_the_free_memory_is_clamped_to_it_with_a_warning():
    tiny = build_pipeline("flux2-deep")
    reference = pipeline_reference(tiny)
    backend = chaos_backend(device_memory=CAPACITY)
    with pytest.warns(UserWarning) as caught:
        handle = offload_core.enable_offload(tiny.pipe, device_memory="64MiB", backend=backend)
    message = clamped("64.0 MiB", "3.0 MiB", "3.0 MiB", 64 * 2**20, CAPACITY)
    assert [str(w.message) for w in caught if "device_memory=" in str(w.message)] == [message]
    assert (handle.plan.budget, handle.plan.asked_budget, handle.strategy) == (CAPACITY, 64 * 2**20, "layerwise")
    assert message in handle.plan.notes
    assert str(handle.plan).startswith("budget 3.0 MiB of 3.0 MiB (clamped from 64.0 MiB): layerwise offload")
    assert torch.equal(tiny.run(), reference)
    assert handle.stats()["device_peak_bytes"] <= CAPACITY
    handle.disable()


def test_the_clamp_is_to_what_is_free_not_to_the_card_and_a_budget_within_it_is_kept():
    """Another user of the device holds 1 MiB: a fraction 1.0 of the device (3 MiB) is above
    the 2 MiB free; 1.5 MiB is within it and planned as given, without a warning."""
    tiny = build_pipeline("flux2-deep")
    backend = chaos_backend(device_memory=CAPACITY)
    other = backend.empty_device(2**20)
    with pytest.warns(UserWarning, match="device_memory=3.0 MiB") as caught:
        handle = offload_core.enable_offload(tiny.pipe, device_memory=1.0, backend=backend)
    assert clamped("3.0 MiB", "2.0 MiB", "3.0 MiB", CAPACITY, 2 * 2**20) in [str(w.message) for w in caught]
    assert handle.plan.budget == 2 * 2**20
    handle.disable()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        handle = offload_core.enable_offload(tiny.pipe, device_memory="1.5MiB", backend=backend)
    assert handle.plan.budget == handle.plan.asked_budget == 1.5 * 2**20
    handle.disable()
    del other


def test_a_device_that_fills_during_enable_is_an_error_naming_the_budget(monkeypatch):
    """Another user of the device takes 2 MiB after the plan was made: the allocator fails, and
    the error says which budget and peak the device could not hold; the pipeline is as it was,
    and enables once the memory is back."""
    from offload_core.enabling import enable as enable_module

    tiny = build_pipeline("flux2-deep")
    reference = pipeline_reference(tiny)
    backend = chaos_backend(device_memory=CAPACITY)
    fit, taken = enable_module.fit, []

    def fit_then_another_user_allocates(*args):
        fitted = fit(*args)
        taken.append(backend.empty_device(2 * 2**20))
        return fitted

    monkeypatch.setattr(enable_module, "fit", fit_then_another_user_allocates)
    before = [p.data_ptr() for p in tiny.pipe.transformer.parameters()]
    with pytest.raises(torch.OutOfMemoryError) as error:
        offload_core.enable_offload(tiny.pipe, device_memory="3MiB", backend=backend)
    message = str(error.value)
    assert message.startswith("enable ran out of memory and was rolled back, the model is as it was (fake device "
                              "out of memory: tried to allocate ")
    assert message.endswith("under device_memory=3.0 MiB, planned to peak at 3.0 MiB on the device, which has 1.0 MiB "
                            "free of 3.0 MiB now; if the device filled, other users took memory meanwhile or the "
                            "allocator needs more than the plan counts: give a smaller device_memory")
    assert isinstance(error.value.__cause__, torch.OutOfMemoryError)
    assert not hasattr(tiny.pipe, "_offload_core_handle")
    assert [p.data_ptr() for p in tiny.pipe.transformer.parameters()] == before
    assert backend.memory_allocated() == 2 * 2**20, "everything enable allocated was freed"
    taken.clear()
    monkeypatch.setattr(enable_module, "fit", fit)
    handle = offload_core.enable_offload(tiny.pipe, device_memory="3MiB", backend=backend)
    assert torch.equal(tiny.run(), reference)
    handle.disable()


def test_offload_core_plan_checks_the_budget_against_the_backend_it_names(capsys, monkeypatch):
    import offload_core.device.plugins

    capped = chaos_backend(device_memory=CAPACITY)
    get_backend = offload_core.device.plugins.get_backend
    monkeypatch.setattr(offload_core.device.plugins, "get_backend",
                        lambda name=None, **options: capped if name == "fake" else get_backend(name, **options))
    assert main(["plan", "--backend", "fake", "--device-memory", "64MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["budget"], data["asked_budget"], data["device_total"]) == (CAPACITY, 64 * 2**20, CAPACITY)
    assert data["notes"][0] == clamped("64.0 MiB", "3.0 MiB", "3.0 MiB", 64 * 2**20, CAPACITY)
    assert main(["plan", "--backend", "fake", "--device-memory", "0.5"]) == 0
    assert capsys.readouterr().out.startswith("budget 1.5 MiB of 3.0 MiB: layerwise offload, chosen by the budget\n")
    # without a backend named (and no accelerator here), the plan is for any card: not checked
    assert main(["plan", "--device-memory", "64MiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert (data["budget"], data["asked_budget"], data["device_total"]) == (64 * 2**20, 64 * 2**20, None)
    assert main(["plan", "--backend", "nope", "--device-memory", "64MiB"]) == 2
    assert "nope" in capsys.readouterr().err
