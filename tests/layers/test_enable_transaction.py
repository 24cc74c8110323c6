"""The enable transaction (offload_core/enabling/enable.py) is one path for a module and a
pipeline alike: a failure at its very last step (an install half put on the target) leaves either
target exactly as it was, unregistered, so that it can be enabled again. And the path flows
downward: a static walk of where ``enable_offload``'s target goes (tools/enable_walk.py) climbs
back up to a higher layer at most four times, and reads each fact of a pipeline once."""

from __future__ import annotations

import gc
import textwrap

import pytest
import torch
from torch import nn

import offload_core
from offload_core.handle import HANDLE_ATTRIBUTE
from offload_core.enabling.installs import Mark
from offload_core.tiny import build_pipeline

from contract_models import ENABLE_OPTIONS, build
from helpers import assert_same_state, chaos_backend, snapshot
from import_graph import imports, modules
from tools import enable_walk


def _target(kind: str):
    """A target and its weight-holding roots."""
    if kind == "module":
        model = build()
        return model, [model]
    pipe = build_pipeline("flux2").pipe
    return pipe, [m for m in pipe.components.values() if isinstance(m, nn.Module)]


@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
@pytest.mark.parametrize("kind", ["module", "pipeline"])
def test_a_failure_at_the_last_step_of_enable_leaves_the_target_as_it_was(kind, strategy, monkeypatch):
    target, roots = _target(kind)
    original_class = type(target)
    before = [snapshot(root) for root in roots]
    backend = chaos_backend()
    install = Mark.install

    def half_installed(self):  # the mark is on the target when it fails
        install(self)
        raise RuntimeError("the last install fails")

    monkeypatch.setattr(Mark, "install", half_installed)
    with pytest.raises(RuntimeError, match="the last install fails"):
        offload_core.enable_offload(target, backend=backend, **ENABLE_OPTIONS[strategy])
    assert type(target) is original_class
    assert HANDLE_ATTRIBUTE not in target.__dict__
    for root, state in zip(roots, before):
        assert all("forward" not in m.__dict__ for m in root.modules())
        assert_same_state(state, snapshot(root))
    gc.collect()
    assert backend.memory_allocated() == 0 and backend.pinned_memory_allocated() == 0

    monkeypatch.setattr(Mark, "install", install)
    handle = offload_core.enable_offload(target, backend=backend, **ENABLE_OPTIONS[strategy])  # nothing owns it
    assert handle.enabled and handle.parts and handle.placement is not None
    assert getattr(target, HANDLE_ATTRIBUTE) is handle
    handle.disable()
    assert type(target) is original_class and HANDLE_ATTRIBUTE not in target.__dict__
    for root, state in zip(roots, before):
        assert_same_state(state, snapshot(root))


def test_the_enable_path_climbs_at_most_four_times():
    stays, climbs, _ = enable_walk.walk(enable_walk.Package(enable_walk.ROOT))
    assert "enabling.enable" in stays and "handle" in stays, "the walk no longer follows the target through enable"
    assert len(climbs) <= 4, climbs


def test_each_pipeline_fact_is_read_once():
    """What a target is (a pipeline or not, its components, their kinds) is read from it once,
    into the inventory that enable_offload hands down: no function of pipelines.py is reached
    from two places (the inventory's own methods read what it holds)."""
    asks = enable_walk.walk(enable_walk.Package(enable_walk.ROOT)).asks
    reads = {callee: sites for callee, sites in asks.items()
             if callee.startswith("discovery.pipelines.") and not callee.startswith("discovery.pipelines.Inventory.")}
    assert {"discovery.pipelines.is_pipeline", "discovery.pipelines.pipeline_modules"} <= reads.keys()
    assert {callee: sites for callee, sites in reads.items() if len(sites) > 1} == {}


#: beside the library: the command, its benchmarks and demos, the pytest plugin (docs/design.md)
BESIDE = ("cli", "__main__", "bench", "tiny", "testing")


def test_imports_go_down_the_layers():
    """Every library module has a layer (the table the walk and docs/design.md use) and imports
    only from its own layer and the ones below."""
    known = modules()
    climbing = []
    for name, path in known.items():
        short = name.partition(".")[2]
        if not short or short.startswith(BESIDE):
            continue
        assert enable_walk.layer(short) is not None, f"{short} has no layer in tools/enable_walk.py"
        for imported in imports(name, path, known):
            if enable_walk.layer(imported.partition(".")[2]) < enable_walk.layer(short):
                climbing.append((short, imported))
    assert climbing == []


def test_the_walk_sees_a_climb(tmp_path):
    package = tmp_path / "pkg"
    (package / "strategies").mkdir(parents=True)
    (package / "api.py").write_text(textwrap.dedent("""
        from .strategies.part import pack

        def enable_offload(target):
            model = target.model
            return pack(model)
    """))
    (package / "strategies" / "__init__.py").write_text("")
    (package / "strategies" / "part.py").write_text(textwrap.dedent("""
        from ..handle import Handle

        def pack(module):
            return Handle(module)
    """))
    (package / "handle.py").write_text(textwrap.dedent("""
        class Handle:
            def __init__(self, target):
                self.target = target
    """))
    stays, climbs, _ = enable_walk.walk(enable_walk.Package(package))
    assert stays == {"api": {"enable_offload"}, "strategies.part": {"pack"}, "handle": {"Handle.__init__"}}
    assert climbs == [("strategies.part", "pack", "handle", "__init__")]


def test_failure_in_a_later_component_rolls_back_the_earlier_ones(flux2):
    """Packing succeeds for the DiT, then the device runs out for the resident encoder: all undone."""
    before = {n: snapshot(m) for n, m in flux2.pipe.components.items() if isinstance(m, nn.Module)}
    probe = offload_core.enable_offload(flux2.pipe, enable_layerwise_offload=True, backend=chaos_backend())
    streamed = probe.describe()[0]["device_weight_bytes"]
    probe.disable()
    backend = chaos_backend(device_memory=streamed + 16)
    with pytest.raises(torch.OutOfMemoryError):
        offload_core.enable_offload(flux2.pipe, enable_layerwise_offload=True, backend=backend)
    for name, state in before.items():
        assert_same_state(state, snapshot(flux2.pipe.components[name]))
    assert backend.memory_allocated() == 0
    assert torch.equal(flux2.run(seed=0), flux2.expected)
