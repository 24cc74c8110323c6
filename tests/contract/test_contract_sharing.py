"""Contract points 6 and 7 (docs/design.md): one offloaded model called from several threads is
serialised (one call at a time per handle) and every output is exact; two offloaded models on one
backend keep working side by side; enabling offload on anything that contains, or is contained
in, an offloaded model or pipeline is refused with an error naming the handle, and handles can
be disabled in any order."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import offload_core
from offload_core.tiny import build_pipeline

from contract_models import ENABLE_OPTIONS
from helpers import assert_same_state, chaos_backend, snapshot
from stacks import StackSpec, build_stack

MIXED = [[torch.float32, torch.bfloat16], [torch.float16], [torch.float32], [torch.bfloat16, torch.float32], [torch.float32]]


def stack(seed: int = 0) -> nn.Module:
    return build_stack(StackSpec(d=8, layer_dtypes=MIXED, transposed=True, tie_within=True, tie_head=True, seed=seed))


def inputs(n: int) -> list[torch.Tensor]:
    return [torch.randn(3, 8, generator=torch.Generator().manual_seed(i)) for i in range(n)]


def call_in_threads(calls: list, threads: int = 2) -> dict[int, torch.Tensor]:
    """Run ``calls`` (index -> callable) split over ``threads`` threads started together."""
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(threads)

    def worker(k: int) -> None:
        start.wait()
        try:
            for i in range(k, len(calls), threads):
                results[i] = calls[i]()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_two_threads_calling_one_offloaded_model_get_exact_outputs(strategy):
    model = stack()
    xs = inputs(16)
    with torch.no_grad():
        expected = [model(x) for x in xs]
    handle = offload_core.enable_offload(model, backend=chaos_backend(), **ENABLE_OPTIONS[strategy])

    def call(x):
        def go():
            with torch.no_grad():
                return model(x)
        return go

    results = call_in_threads([call(x) for x in xs])
    assert all(torch.equal(results[i], expected[i]) for i in range(len(xs)))
    handle.disable()


def test_two_offloaded_models_on_one_backend_run_side_by_side():
    backend = chaos_backend()
    models = [stack(seed) for seed in (1, 2)]
    xs = inputs(8)
    with torch.no_grad():
        expected = [models[i % 2](x) for i, x in enumerate(xs)]
    handles = [
        offload_core.enable_offload(models[0], enable_layerwise_offload=True, backend=backend),
        offload_core.enable_offload(models[1], enable_cpu_offload=True, backend=backend),
    ]

    def call(i):
        def go():
            with torch.no_grad():
                return models[i % 2](xs[i])
        return go

    results = call_in_threads([call(i) for i in range(len(xs))])
    assert all(torch.equal(results[i], expected[i]) for i in range(len(xs)))
    for handle in handles:
        handle.disable()


def test_two_threads_calling_one_offloaded_pipeline_are_serialised():
    tiny = build_pipeline("flux2")
    expected = tiny.run(seed=0)
    handle = offload_core.enable_offload(tiny.pipe, enable_cpu_offload=True, backend=chaos_backend())
    results = call_in_threads([lambda: tiny.run(seed=0)] * 4)
    assert all(torch.equal(r, expected) for r in results.values())
    handle.disable()


def test_enabling_inside_or_around_an_offloaded_pipeline_is_refused():
    tiny = build_pipeline("flux2")
    expected = tiny.run(seed=0)
    transformer = tiny.pipe.transformer
    before = snapshot(transformer)
    handle = offload_core.enable_offload(tiny.pipe, enable_layerwise_offload=True, backend=chaos_backend())
    named = r"already enabled.*<OffloadHandle layerwise on Flux2Pipeline"
    for target in (transformer, transformer.transformer_blocks[0], nn.Sequential(transformer)):
        with pytest.raises(offload_core.AlreadyEnabledError, match=named):
            offload_core.enable_offload(target, enable_cpu_offload=True, backend=chaos_backend())
    sharing = type(tiny.pipe).__mro__[1](**tiny.pipe.components)  # a second pipeline on the same components
    with pytest.raises(offload_core.AlreadyEnabledError, match=named):
        offload_core.enable_offload(sharing, enable_cpu_offload=True, backend=chaos_backend())
    assert torch.equal(tiny.run(seed=0), expected)
    handle.disable()
    assert_same_state(before, snapshot(transformer))
    again = offload_core.enable_offload(transformer, enable_layerwise_offload=True, backend=chaos_backend())
    assert torch.equal(tiny.run(seed=0), expected)
    again.disable()


def test_enabling_around_an_offloaded_model_or_on_a_shared_parameter_is_refused():
    model = stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    other = stack(seed=5)
    other.head.weight = model.head.weight  # a parameter shared with the offloaded model
    with pytest.raises(offload_core.AlreadyEnabledError, match=r"parameter head\.weight.*OffloadHandle layerwise on Stack"):
        offload_core.enable_offload(other, enable_layerwise_offload=True, backend=chaos_backend())
    assert no_forward_wrappers(other)
    handle.disable()


def no_forward_wrappers(model: nn.Module) -> bool:
    return all("forward" not in m.__dict__ for m in model.modules())


@pytest.mark.parametrize("order", ["enable order", "reverse order"])
def test_handles_disable_in_any_order(order):
    backend = chaos_backend()
    tiny = build_pipeline("flux2")
    models = [stack(1), stack(2)]
    x = inputs(1)[0]
    with torch.no_grad():
        expected = [m(x) for m in models]
    expected_pipe = tiny.run(seed=0)
    befores = [snapshot(m) for m in models] + [snapshot(tiny.pipe.transformer)]
    handles = [
        offload_core.enable_offload(models[0], enable_layerwise_offload=True, backend=backend),
        offload_core.enable_offload(tiny.pipe, enable_cpu_offload=True, backend=backend),
        offload_core.enable_offload(models[1], enable_cpu_offload=True, backend=backend),
    ]
    with torch.no_grad():
        assert all(torch.equal(m(x), e) for m, e in zip(models, expected))
    assert torch.equal(tiny.run(seed=0), expected_pipe)
    for handle in handles if order == "enable order" else reversed(handles):
        handle.disable()
    for before, module in zip(befores, [*models, tiny.pipe.transformer]):
        assert_same_state(before, snapshot(module))
        assert no_forward_wrappers(module)
    with torch.no_grad():
        assert all(torch.equal(m(x), e) for m, e in zip(models, expected))
    assert torch.equal(tiny.run(seed=0), expected_pipe)
