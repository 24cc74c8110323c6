"""The torch.compile checks of the compatibility table (docs/compatibility.md, the torch.compile
rows): regional compilation and the whole model compiled, before or after ``enable_offload``, give
the compiled model's outputs exactly, with no graph added by offload and none per step;
``fullgraph=True`` on a streamed model is refused at its first call. Each check is a cell's
function: test_compile.py runs the model-level and layerwise cells, test_compatibility.py the
distributed ones on two processes."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

from offload_core.discovery import find_blocks

from compat_cases import STEPS, assert_equal, dynamo_backend, expect, offloaded, perturbed, run_steps
from denoisers import build_transformer
from helpers import assert_same_state, snapshot
from tools.compatibility import REFUSED, YES

# Graphs are counted with Dynamo's own counter. aot_eager runs all of Dynamo and AOTAutograd
# (guards, graph breaks, functionalisation, input aliasing), which is where offloading and
# compilation meet; inductor only changes the kernels inside a graph, and costs tens of seconds
# per graph on a CPU. So inductor runs where users' performance lives (regional compilation,
# layerwise: slot views as inputs to generated kernels) and aot_eager everywhere else.

def graphs() -> int:
    return counters["stats"]["unique_graphs"]


def distinct_blocks(model: nn.Module) -> int:
    return len({type(block) for _, block in find_blocks(model)})


_COMPILED: dict[tuple, tuple] = {}


def fresh_dynamo() -> None:
    """Forget every compiled frame (and so every reference built on them). Dynamo's cache is per
    code object and shared by all torch.compile calls: a frame compiled before would be reused
    instead of traced again, whatever the new call's ``fullgraph``."""
    torch._dynamo.reset()
    _COMPILED.clear()


def compiled_reference(how: str, dynamo_backend: str, name: str) -> tuple[nn.Module, dict, list[torch.Tensor]]:
    """(model, inputs, outputs) of ``name`` compiled without offload, from a clean Dynamo cache,
    built once per process: the strategies then enable offload on this same compiled model.

    "regional" compiles the repeated blocks in place and checks that this makes exactly one graph
    per distinct block; "whole" compiles the model with ``fullgraph=True``, which proves that the
    model allows one graph; later ``torch.compile(model)`` calls reuse that graph."""
    key = (how, dynamo_backend, name)
    if key not in _COMPILED:
        fresh_dynamo()
        model, inputs = build_transformer(name)
        start = graphs()
        if how == "regional":
            model.compile_repeated_blocks(backend=dynamo_backend, fullgraph=True)
            expected = run_steps(model, inputs)
            assert graphs() - start == distinct_blocks(model), "regional compilation: one graph per distinct block"
        else:
            expected = run_steps(torch.compile(model, backend=dynamo_backend, fullgraph=True), inputs)
            assert graphs() - start == 1
        _COMPILED[key] = (model, inputs, expected)
    return _COMPILED[key]


def _steps_without_new_graphs(call, inputs, expected, what: str, first_may_compile: bool = False) -> None:
    """Offloaded steps equal the compiled reference; no graph is compiled per step (and none at all
    unless ``first_may_compile``: the first offloaded call may compile once)."""
    start = graphs()
    outputs = run_steps(call, inputs, steps=1)
    if not first_may_compile:
        assert graphs() == start, f"{what}: offload made Dynamo compile {graphs() - start} new graphs"
    settled = graphs()
    outputs += [run_steps(call, perturbed(inputs, s, 0.1), steps=1)[0] for s in range(1, STEPS)]
    assert graphs() == settled, f"{what}: Dynamo recompiled during steps ({graphs() - settled} graphs)"
    assert_equal(outputs, expected, what)


def compile_regional(strategy: str, backend, verdict: str) -> None:
    expect(verdict, YES)
    dynamo = dynamo_backend(verdict)
    name = "wan-t2v" if dynamo == "inductor" else "flux2"  # inductor: one block class, one slow C++ build
    model, inputs, expected = compiled_reference("regional", dynamo, name)
    with offloaded(model, strategy, backend):  # compiled before enable
        _steps_without_new_graphs(model, inputs, expected, f"{strategy}: compiled before enable")
    fresh, _ = build_transformer(name)
    with offloaded(fresh, strategy, backend):  # compiled after enable, block by block
        for _, block in find_blocks(fresh):
            block.compile(backend=dynamo, fullgraph=True)
        _steps_without_new_graphs(fresh, inputs, expected, f"{strategy}: compiled after enable")
    assert all("_compiled_call_impl" in block.__dict__ for _, block in find_blocks(fresh)), "compilation lost at disable"


def compile_whole(strategy: str, backend, verdict: str) -> None:
    expect(verdict, YES)
    dynamo = dynamo_backend(verdict)
    model, inputs, expected = compiled_reference("whole", dynamo, "flux2")
    streams = strategy != "model"
    with offloaded(model, strategy, backend):  # compiled before enable
        _steps_without_new_graphs(torch.compile(model, backend=dynamo), inputs, expected,
                                  f"{strategy}: compiled before enable", first_may_compile=streams)
    fresh, _ = build_transformer("flux2")
    with offloaded(fresh, strategy, backend):  # compiled after enable
        _steps_without_new_graphs(torch.compile(fresh, backend=dynamo), inputs, expected,
                                  f"{strategy}: compiled after enable", first_may_compile=True)
    if streams:  # each block class compiled once, whichever model instance and step
        for cls in {type(block) for _, block in find_blocks(fresh)}:
            entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(cls.forward.__code__)
            assert len(entries) == 1, f"{cls.__name__}.forward compiled {len(entries)} times"


def compile_whole_fullgraph(strategy: str, backend, verdict: str) -> None:
    """The model allows one graph without offload (the reference proves it); a streamed one is
    refused at its first call: the model-level cell of this row runs the same model."""
    if expect(verdict, YES, REFUSED) == YES:
        dynamo = dynamo_backend(verdict)
        model, inputs, expected = compiled_reference("whole", dynamo, "flux2")
        with offloaded(model, strategy, backend):
            _steps_without_new_graphs(torch.compile(model, backend=dynamo, fullgraph=True), inputs, expected,
                                      f"{strategy}, fullgraph=True")
        return
    model, inputs = build_transformer("flux2")
    before = snapshot(model)
    fresh_dynamo()  # trace with fullgraph=True rather than reuse a frame compiled earlier with breaks
    with offloaded(model, strategy, backend):
        with pytest.raises(torch._dynamo.exc.Unsupported, match="regional compilation"):
            run_steps(torch.compile(model, backend="eager", fullgraph=True), inputs, steps=1)
    assert_same_state(before, snapshot(model))


CASES = {fn.__name__: fn for fn in (compile_regional, compile_whole, compile_whole_fullgraph)}
