"""The timeline the strategies record (``handle.trace()``): per-block compute on the compute lane,
copies on the copy lanes, waits for copies, prefetch misses and host waits as instants; device
times where the backend offers timing events, host times (and no overlap figure) where it does not;
nothing recorded, and no event made, when no trace is attached."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import offload_core
from offload_core import Capability
from offload_core.common.overlap import timeline_overlap
from offload_core.strategies.model_level import ModelLevelOffload
from offload_core.common.transaction import Transaction
from offload_core.common.timeline import Timeline
from offload_core_fake import FakeBackend

from helpers import chaos_backend
from stacks import StackSpec, build_stack

D = 64
BLOCK_BYTES = D * D * 4 + D * 4  # one float32 layer: weight and scale
BANDWIDTH = 20 * BLOCK_BYTES  # a block's copy takes 50 ms


class UntimedFake(FakeBackend):
    """A backend without timing events: the timeline falls back to host times."""

    capabilities = FakeBackend.capabilities - {Capability.TIMING}


def _stack(blocks: int = 4):
    model = build_stack(StackSpec(d=D, layer_dtypes=[[torch.float32]] * blocks, seed=5))
    return model, torch.randn(2, D, generator=torch.Generator().manual_seed(1))


def _traced_forward(backend, depth: int = 1):
    model, x = _stack()
    with torch.no_grad():
        expected = model(x)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend, prefetch_depth=depth)
    backend.synchronize()
    with handle.trace() as timeline:
        with torch.no_grad():
            assert torch.equal(model(x), expected)
    handle.disable()
    return timeline


def test_layerwise_records_each_block_its_copy_and_its_wait():
    timeline = _traced_forward(chaos_backend())
    spans = timeline.spans()
    compute = [s for s in spans if s.kind == "compute"]
    names = [f"Stack.blocks.{i}" for i in range(4)]
    assert [s.name for s in compute] == names and {s.lane for s in compute} == {"compute"}
    waits = {s.name: s for s in spans if s.kind == "wait"}
    for span in compute:  # compute starts where its wait for the copy ended
        assert waits[f"wait {span.name}"].end_ns == span.start_ns
    copies = [s for s in spans if s.kind == "copy"]
    assert copies and all(s.lane == "copy" and s.nbytes == BLOCK_BYTES for s in copies)
    assert {s.name for s in copies} <= {f"load {n}" for n in names}
    assert all(s.start_ns <= s.end_ns for s in spans)
    # the ring wraps: the first blocks of the next forward are loaded at the end of this one
    assert sum(s.name == "load Stack.blocks.0" for s in copies) == 1


def test_copy_spans_are_device_times_where_the_backend_has_timing_events():
    """With a bandwidth model a copy runs 50 ms on its stream while the host only queues it: a
    device-timed span shows the 50 ms, a host-timed one only the queueing."""
    timed = _traced_forward(offload_core.get_backend("fake", h2d_bandwidth=BANDWIDTH))
    untimed = _traced_forward(UntimedFake(h2d_bandwidth=BANDWIDTH))
    seconds = BLOCK_BYTES / BANDWIDTH
    assert timed.device_timed and not untimed.device_timed
    assert all(s.seconds >= 0.9 * seconds for s in timed.spans() if s.kind == "copy")
    assert all(s.seconds < 0.5 * seconds for s in untimed.spans() if s.kind == "copy")
    overlap = timeline_overlap(timed)
    assert overlap is not None and overlap.copy_ns > 0
    assert timeline_overlap(untimed) is None  # host times cannot tell what was hidden


def test_a_block_called_out_of_order_is_an_instant_miss():
    model, x = _stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    with handle.trace() as timeline, torch.no_grad():
        model.blocks[2](x)
    handle.disable()
    [miss] = timeline.instants()
    assert (miss.kind, miss.name, miss.lane) == ("prefetch miss", "prefetch miss Stack.blocks.2", "compute")
    assert handle.stats()["prefetch_misses"] == 1


def test_model_level_records_groups_and_the_host_waiting_for_an_unneeded_prefetch():
    """Groups a, b, c; after a call learns a -> b, b is prefetched when a runs; running c instead
    swaps b out while it may still be loading: the host waits for its copy (an instant)."""
    backend = chaos_backend()
    modules = {name: nn.Linear(D, D) for name in "abc"}
    part = ModelLevelOffload([(n, [(n, m)]) for n, m in modules.items()], backend)
    with Transaction() as txn:
        part.enable(txn)
    x = torch.randn(2, D)
    with torch.no_grad():
        for name in "abc":
            modules[name](x)
        part.release_all()
        part.timeline = Timeline(backend)
        modules["a"](x)
        modules["c"](x)
        part.release_all()
        part.timeline.close()
    timeline, part.timeline = part.timeline, None
    part.disable()
    spans = timeline.spans()
    assert [s.name for s in spans if s.kind == "compute"] == ["a", "c"]
    assert {s.name for s in spans if s.kind == "copy"} == {"load a", "load b", "load c"}
    [wait] = timeline.instants()
    assert (wait.kind, wait.name, wait.lane) == ("host wait", "unload b (still loading)", "host")
    assert wait.duration_ns >= 0


def test_nothing_is_recorded_and_no_event_made_without_a_trace(monkeypatch):
    backend = chaos_backend()
    model, x = _stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    made = []
    new_event = backend.new_event
    monkeypatch.setattr(backend, "new_event", lambda *a, **k: made.append(k) or new_event(*a, **k))
    with torch.no_grad():
        model(x)
    assert made == [] and all(part.timeline is None for part in handle.parts)
    with handle.trace(), torch.no_grad():
        model(x)
    assert made and all(k == {"timing": True} for k in made)
    assert all(part.timeline is None for part in handle.parts)
    handle.disable()


def test_one_trace_at_a_time_and_a_closed_timeline_records_nothing():
    backend = chaos_backend()
    model, x = _stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    with handle.trace() as timeline:
        with pytest.raises(RuntimeError, match="already recording"):
            with handle.trace():
                pass
    with pytest.raises(RuntimeError, match="closed"):
        timeline.copy(backend.new_stream(), "x", 0, lambda: None)
    handle.disable()


def test_chrome_trace_has_a_named_row_per_lane(tmp_path):
    timeline = _traced_forward(chaos_backend())
    path = tmp_path / "trace.json"
    timeline.export_chrome_trace(path)
    events = json.loads(path.read_text())["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert list(rows.values()) == timeline.lanes() == ["compute", "copy"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(timeline.spans())
    assert {(rows[e["tid"]], e["cat"]) for e in spans} == {("compute", "compute"), ("compute", "wait"), ("copy", "copy")}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in spans)


@pytest.mark.parametrize("blocks, depth", [(2, 1), (3, 1), (5, 1), (4, 2), (5, 3)])
def test_every_block_is_copied_in_every_forward(blocks, depth):
    """docs/layerwise.md: nothing stays in a slot across forwards (the host may change in between),
    also a block that has a slot to itself: each forward copies every block once."""
    model, x = _stack(blocks)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         prefetch_depth=depth)
    with torch.no_grad():
        model(x)
        with handle.trace() as timeline:
            model(x)
            model(x)
    handle.disable()
    loaded = [int(s.name.rsplit(".", 1)[1]) for s in timeline.spans() if s.kind == "copy"]
    assert sorted(loaded) == sorted(list(range(blocks)) * 2)

def test_the_run_picture_names_the_time_outside_the_loop_the_blocks_and_the_resident_memory():
    """``offload-core run --timeline``'s picture: the time before the denoising loop is shaded and
    named in the legend (no streamed block computes there), runs of blocks too narrow to name one by one carry
    their range, and the memory lane has the all-resident reference beside the sampled line."""
    pytest.importorskip("matplotlib")
    import re

    from offload_core import cli
    from offload_core.cli.run.command import run_pipeline
    from offload_core.cli.run.drawing import block_runs, timeline_figure

    result = run_pipeline(cli.build_parser().parse_args(["run", "--json"]), backend=FakeBackend())
    try:
        figure = timeline_figure(result.timeline, result.report, result.measured)
        lanes, memory = figure.axes[:2]
        texts = [t.get_text() for t in lanes.texts]
        shaded = [p for p in lanes.patches if p.get_label() == "prompt encoding"]
        assert result.measured.loop_start_ms > 0 and len(shaded) == 1
        x0 = shaded[0].get_x()
        assert (x0, x0 + shaded[0].get_width()) == (0.0, pytest.approx(result.measured.loop_start_ms))
        # named in the legend; in the lane too where the label fits, which on a loaded machine, whose
        # denoising loop slows more than the encoding, it may not
        legend = [t.get_text() for t in lanes.get_legend().get_texts()]
        assert "prompt encoding" in legend, legend
        runs = block_runs(result.timeline.spans())
        assert ("single_transformer_blocks.0-15" in [r[2] for r in runs]) and len(runs) == 2 * result.report["steps"]
        assert any(re.fullmatch(r"(\w+\.)?\d+-\d+", t) for t in texts), texts
        resident = result.report["device_bytes_without_offload"] / 2**20
        reference = [line for line in memory.get_lines() if line.get_label().startswith("without offload")]
        assert len(reference) == 1 and reference[0].get_ydata()[0] == pytest.approx(resident)
        assert memory.get_ylim()[1] > resident
    finally:
        result.close()
