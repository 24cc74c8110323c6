"""Every handle has a plan (``print(handle.plan)``), with or without a device budget, and its
figures are what the handle then does, on the fake (whose device accounting counts the weights
only, so that the device figures are exact): the bytes copied per forward or per call against
``handle.stats()``, the device bytes held against the measured peak, the host bytes against the
homes. Model-level, layerwise (a bare model and a pipeline) and distributed (two ranks, gloo)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.multiprocessing as mp

import offload_core
from offload_core.tiny import build_pipeline

from helpers import chaos_backend, free_port, pipeline_reference
from stacks import StackSpec, build_stack
from plan_copies import copied_as_planned, streamed_copies

pytestmark = pytest.mark.fake_only("the fake counts only the weights' device memory: the peaks are exact")

D = 32


def stack():
    return build_stack(StackSpec(d=D, layer_dtypes=[[torch.float32]] * 5, seed=3))


def weights_held(plan) -> int:
    """What the plan says the device holds all run (its peak less the activation headroom)."""
    held = sum(c.device_bytes for c in plan.components)
    assert plan.device_peak == held + max(c.activation_bytes for c in plan.components)
    return held


def host_planned(plan) -> int:
    return sum(v for c in plan.components for tier, v in c.host.items() if tier != "disk")


def test_a_layerwise_model_without_a_budget_has_the_plan_it_runs():
    model = stack()
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    plan = handle.plan
    (c,) = plan.components
    assert (plan.strategy, plan.chosen_by, plan.budget, c.mode) == ("layerwise", "flag", None, "streamed")
    assert c.streamed_blocks == tuple(range(5)) and c.resident_blocks == ()
    text = str(plan)
    assert text.startswith("no device budget: layerwise offload, chosen by the strategy flag\n")
    assert "Stack (dit): 0 of 5 blocks resident" in text and "per forward      5 copies" in text
    before = handle.stats()
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    after = handle.stats()
    assert after["h2d_bytes"] - before["h2d_bytes"] == c.bytes_per_forward == plan.bytes_per_forward["Stack"]
    assert after["h2d_copies"] - before["h2d_copies"] == c.copies_per_forward
    assert after["device_peak_bytes"] == weights_held(plan) == c.device_bytes
    assert after["host_bytes"] == host_planned(plan)
    handle.disable()


def test_a_model_level_model_without_a_budget_has_the_plan_it_runs():
    model = stack()
    x = torch.randn(2, D)
    handle = offload_core.enable_offload(model, enable_cpu_offload=True, backend=chaos_backend())
    (c,) = handle.plan.components
    assert (handle.plan.strategy, c.mode) == ("model", "swapped")
    assert "Stack (dit): swapped in with its group" in str(handle.plan)
    before = handle.stats()
    with torch.no_grad():
        model(x)
    after = handle.stats()
    assert after["h2d_bytes"] - before["h2d_bytes"] == c.bytes_per_call == c.weight_bytes
    # the plan read after the call has its measured activations (none on the fake) in its peak
    measured = handle.plan
    assert measured.component("Stack").activation_source == "measured"
    assert after["device_peak_bytes"] == measured.device_peak == c.weight_bytes + measured.component("Stack").activation_bytes
    assert after["host_bytes"] == host_planned(handle.plan)
    handle.disable()


def test_describe_says_per_part_what_streams_what_stays_and_its_slots():
    """``handle.describe()``: plain data per part that names the blocks the plan keeps and streams,
    with slot and byte figures that agree with ``stats()``, the same after a re-pack; a part that
    streams no blocks (model-level) says so with empty lists and zeros."""
    model = stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         resident_blocks=2, prefetch_depth=1)
    (c,) = handle.plan.components
    (part,) = handle.describe()
    assert json.loads(json.dumps(part)) == part
    assert part["part"] == "Stack"
    assert part["kept_blocks"] == [f"blocks.{i}" for i in c.resident_blocks] and len(c.resident_blocks) == 2
    assert part["streamed_blocks"] == [f"blocks.{i}" for i in c.streamed_blocks]
    assert part["slots"] == 2 and part["slot_bytes"] == c.slot_bytes // 2 > 0
    stats = handle.stats()
    assert part["device_weight_bytes"] == part["resident_bytes"] + 2 * part["slot_bytes"]
    assert part["device_weight_bytes"] == stats["device_weight_bytes"]
    assert part["host_bytes"] == stats["host_bytes"]
    model.blocks[4].double()  # a block that no longer fits its slot: the part re-packs with larger slots
    (after,) = handle.describe()
    assert after["slot_bytes"] > part["slot_bytes"] and after["streamed_blocks"] == part["streamed_blocks"]
    handle.disable()

    handle = offload_core.enable_offload(stack(), enable_cpu_offload=True, backend=chaos_backend())
    (part,) = handle.describe()
    assert part["streamed_blocks"] == part["kept_blocks"] == []
    assert part["slots"] == part["slot_bytes"] == part["resident_bytes"] == 0
    assert part["host_bytes"] == handle.stats()["host_bytes"] == handle.plan.components[0].weight_bytes
    handle.disable()


@pytest.mark.parametrize("name", ["flux2-deep", "wan2.2-t2v"])
def test_a_layerwise_pipeline_without_a_budget_has_the_plan_it_runs(name):
    tiny = build_pipeline(name)
    reference = pipeline_reference(tiny)
    backend = chaos_backend()
    handle = offload_core.enable_offload(tiny.pipe, enable_layerwise_offload=True, backend=backend)
    plan = handle.plan
    modes = {c.name: c.mode for c in plan.components}
    assert {modes[n] for n in modes if "transformer" in n} == {"streamed"}
    assert modes["text_encoder"] == modes["vae"] == "resident", "components=('dit',): the others stay resident"
    start = streamed_copies(handle)
    backend.reset_peak_memory_stats()
    assert torch.equal(tiny.run(), reference)
    copied_as_planned(handle, start, plan)  # every streamed component: forwards x its planned bytes per forward
    stats = handle.stats()
    assert stats["device_peak_bytes"] == weights_held(plan)
    assert stats["host_bytes"] == host_planned(plan)
    handle.disable()


def test_a_model_level_pipeline_without_a_budget_copies_what_its_plan_says_per_call():
    tiny = build_pipeline("flux2-deep")
    backend = chaos_backend()
    handle = offload_core.enable_offload(tiny.pipe, enable_cpu_offload=True, backend=backend)
    plan = handle.plan
    assert {c.mode for c in plan.components} == {"swapped"}
    before = handle.stats()
    tiny.run()  # the first call: no group is prefetched yet, one is on the device at a time
    after = handle.stats()
    assert after["h2d_bytes"] - before["h2d_bytes"] == sum(c.bytes_per_call for c in plan.components)
    peak_group = max(plan.components, key=lambda c: c.weight_bytes + c.activation_bytes)
    assert after["device_peak_bytes"] == plan.device_peak - peak_group.activation_bytes == peak_group.weight_bytes
    assert after["host_bytes"] == host_planned(plan)
    handle.disable()


def test_a_budgeted_handle_keeps_the_planners_plan():
    tiny = build_pipeline("flux2-deep")
    handle = offload_core.enable_offload(tiny.pipe, device_memory="2MiB", activation_memory=2**14,
                                         backend=chaos_backend())
    assert (handle.plan.chosen_by, handle.plan.budget, handle.plan.asked_budget) == ("budget", 2 * 2**20, 2 * 2**20)
    assert str(handle.plan).startswith("budget 2.0 MiB of ")
    handle.disable()


def _distributed_worker(rank: int, port: int, world: int) -> None:
    import sys

    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    torch.set_num_threads(1)
    import offload_core

    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    backend.init_process_group(rank, world, f"tcp://127.0.0.1:{port}")
    model = stack()
    x = torch.randn(2, D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x)
    handle = offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend)
    plan = handle.plan
    (c,) = plan.components
    assert (plan.strategy, plan.budget, c.mode, c.streamed_blocks) == ("distributed", None, "streamed", tuple(range(5)))
    assert f"distributed over {world} ranks" in str(plan)
    before = handle.stats()
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    after = handle.stats()
    # each rank copies its 1/N shard of every block, then gathers the block on its device
    assert after["h2d_bytes"] - before["h2d_bytes"] == c.bytes_per_forward // world
    assert after["device_peak_bytes"] == weights_held(plan)
    assert after["host_bytes"] == host_planned(plan)
    handle.disable()


def test_a_distributed_handle_without_a_budget_has_the_plan_it_runs():
    mp.spawn(_distributed_worker, args=(free_port(), 2), nprocs=2, join=True)
