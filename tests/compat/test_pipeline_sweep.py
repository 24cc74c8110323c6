"""The sweep: every diffusers pipeline of ``SWEEP`` of ``tests/sweep/`` (classes beyond the supported
table, and table pipelines in the one-block shapes of diffusers' fast tests) gives, on the fake backend in
chaos mode, images ``torch.equal`` to no offload with model-level offload, layerwise offload and layerwise
offload of every component group; no component makes enable fail.

Marked ``sweep`` (``pytest -m "not sweep"`` leaves it out while working); CI runs it with everything else.
"""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.discovery.pipelines import component_kind, pipeline_modules
from offload_core.strategies.layerwise import LayerwiseOffload
from offload_core.strategies.model_level import ModelLevelOffload
from sweep import SWEEP, build_sweep_pipeline

from helpers import chaos_backend

pytestmark = pytest.mark.sweep

EVERY_GROUP = ("dit", "text_encoder", "vae")


@pytest.fixture(scope="module", params=list(SWEEP))
def tiny(request):
    """A sweep pipeline and its output without offload."""
    tiny = build_sweep_pipeline(request.param)
    tiny.expected = tiny.run(seed=0)
    assert not tiny.expected.isnan().any(), "the pipeline without offload gives NaN: the comparison would be void"
    return tiny


def _placement(handle) -> dict[int, str]:
    """id(component module) -> "streamed" | "staged" for the components the handle moves."""
    where = {}
    for part in handle.parts:
        if isinstance(part, LayerwiseOffload):
            where[id(part.model)] = "streamed"
            assert part.num_slots == min(1, len(part.units) - 1) + 1, "one block gets one slot, more get two"
        elif isinstance(part, ModelLevelOffload):
            for group in part.groups:
                for c in group.components:
                    where[id(c.module)] = "staged"
    return where


def _run_offloaded(tiny, **options):
    handle = offload_core.enable_offload(tiny.pipe, backend=chaos_backend(), **options)
    try:
        assert torch.equal(tiny.run(seed=0), tiny.expected)
        return handle, _placement(handle)
    finally:
        handle.disable()


def _components(tiny, kinds) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in pipeline_modules(tiny.pipe) if component_kind(tiny.pipe, n) in kinds]


def test_model_level_equals_no_offload(tiny):
    _, where = _run_offloaded(tiny, enable_cpu_offload=True)
    assert {id(m) for _, m in pipeline_modules(tiny.pipe)} <= where.keys()


def test_layerwise_equals_no_offload(tiny):
    handle, where = _run_offloaded(tiny, enable_layerwise_offload=True)
    for name, module in _components(tiny, ("dit",)):
        assert where.get(id(module)) == "streamed", f"{name} ({type(module).__name__}) is not streamed"
    assert handle.stats()["prefetch_misses"] == 0


def test_layerwise_every_component_group_equals_no_offload(tiny):
    _, where = _run_offloaded(tiny, enable_layerwise_offload=True, components=EVERY_GROUP)
    for name, module in _components(tiny, EVERY_GROUP):
        assert id(module) in where, f"{name} ({type(module).__name__}) stayed resident"
    assert torch.equal(tiny.run(seed=0), tiny.expected), "disable did not restore the pipeline"


def test_the_sweep_covers_at_least_thirty_pipeline_classes_beyond_the_supported_table():
    from tools.supported_models import beyond_table

    assert len(beyond_table([spec.cls_name for spec in SWEEP.values()])) >= 30


def test_a_device_budget_gives_each_phase_the_device_and_equals_no_offload(tiny):
    """Every sweep pipeline under a budget a third of the way from layerwise offload's smallest to
    all its weights (its smallest, where streaming a tiny model takes more than all of it): the plan has phases covering every component (known, or the generic rule),
    the call is exact within the budget, and the phases it really had are stated afterwards."""
    from offload_core.planning.fitting import pipeline_plan_inputs
    from offload_core.planning import make_plan

    inputs = pipeline_plan_inputs(tiny.pipe, pipeline_modules(tiny.pipe), cls_name=type(tiny.pipe).__name__)
    floor = make_plan(inputs.components, 2**40, strategy="layerwise", phases=inputs.phases,
                      steps=inputs.steps).min_budget
    budget = floor + max(sum(c.total_bytes for c in inputs.components) - floor, 0) // 3
    handle = offload_core.enable_offload(tiny.pipe, enable_layerwise_offload=True, device_memory=budget,
                                         backend=chaos_backend(device_memory=budget))
    try:
        planned = {name for phase in handle.plan.phases for name in phase.components}
        assert planned == {c.name for c in handle.plan.components}
        assert torch.equal(tiny.run(seed=0), tiny.expected)
        assert handle.stats()["device_peak_bytes"] <= budget
        seen = {name for phase in handle.plan.observed_phases for name in phase.components}
        streamed = {c.name for c in handle.plan.components if c.mode == "streamed" and c.parks}
        assert streamed <= seen, "every component that parks is seen beginning its forwards"
    finally:
        handle.disable()
