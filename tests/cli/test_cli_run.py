"""``offload-core run``: every embedded pipeline under every strategy gives the image of a run
without offload, the report repeats the handle's own counters and the timeline the strategies
recorded, the default demo shows offloading, the files it writes are readable and written all or
none, and bad input is one line on stderr with exit status 2 before any work starts."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import time
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import offload_core
from offload_core import cli
from offload_core.cli.run import STRATEGY_CHOICES, loading
from offload_core.cli.run.arguments import DEFAULT_PIPELINE, DEMO_STEPS, MAX_STEPS, embedded
from offload_core.cli.run.command import run_pipeline
from offload_core.cli.run.report import render
from offload_core.device.plugins import ENV_BACKEND, registry
from offload_core.common.overlap import copy_overlap
from offload_core.tiny import PIPELINES, build_pipeline
from tools import cli_samples as sample

from helpers import chaos_backend

SEED = 3
STEPS = "2"
#: report fields that are the handle's ``stats()`` under the same name
STATS_FIELDS = (
    "h2d_bytes", "h2d_copies", "prefetch_misses", "loads", "device_peak_bytes", "pinned_host_bytes", "host_bytes",
)
#: report fields that do not depend on timing, so two runs of the same command agree on them
STABLE_FIELDS = (
    "pipeline", "pipeline_class", "strategy", "backend", "prefetch_depth", "steps", "seed", "height", "width",
    "frames", "output_shape", "device_bytes_without_offload", *STATS_FIELDS,
)


pytestmark = pytest.mark.usefixtures("no_env_override")


@pytest.fixture(scope="module", autouse=True)
def library_warnings_already_shown():
    """Import every pipeline class once, outside any test's captured stderr: transformers warns
    once per process about optional packages (torchvision), and that line is not the command's."""
    import diffusers

    for spec in PIPELINES.values():
        getattr(diffusers, spec.cls_name)


@pytest.fixture(scope="module")
def reference():
    """Per pipeline name: the output of the tiny pipeline without offload, same seed (the demo at its
    steps), and its weight bytes."""
    cache: dict[str, tuple[torch.Tensor, int]] = {}

    def get(name: str) -> tuple[torch.Tensor, int]:
        if name not in cache:
            tiny = build_pipeline(name)
            storages: dict[int, int] = {}
            for module in tiny.pipe.components.values():
                if isinstance(module, torch.nn.Module):
                    for _, t in [*module.named_parameters(), *module.named_buffers()]:
                        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            demo = {"num_inference_steps": DEMO_STEPS} if name == DEFAULT_PIPELINE else {}
            cache[name] = (tiny.run(seed=SEED, **demo), sum(storages.values()))
        return cache[name]

    return get


def main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def parse(*argv: str):
    return cli.build_parser().parse_args(["run", *argv])


#: one process each; distributed runs under torchrun in tests/cli/test_cli_distributed.py
SINGLE_PROCESS = [s for s in STRATEGY_CHOICES if s != "distributed"]


@pytest.mark.parametrize("strategy", SINGLE_PROCESS)
@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.quick) if n == "flux2" else n for n in PIPELINES])
def test_every_pipeline_and_strategy(name, strategy, capsys, reference):
    argv = ["--pipeline", name, "--strategy", strategy, "--steps", STEPS, "--seed", str(SEED), "--json"]
    code, out, _ = main(capsys, *argv)
    assert code == 0
    printed = json.loads(out)

    backend = None if strategy == "none" else chaos_backend()
    result = run_pipeline(parse(*argv), backend=backend)
    try:
        report = result.report
        expected, weights = reference(name)
        assert torch.equal(result.output, expected)
        assert {k: printed[k] for k in STABLE_FIELDS} == {k: report[k] for k in STABLE_FIELDS}
        assert report["steps"] == int(STEPS)
        steps = report["step_times_s"]
        assert len(steps) == int(STEPS) and all(t > 0 for t in steps) and sum(steps) < report["wall_time_s"]
        net = [t - c for t, c in zip(steps, report["collected_s"])]  # garbage collections left out
        assert (report["first_step_s"], report["step_s"]) == (net[0], statistics.median(net[1:]))
        assert report["output_shape"] == list(expected.shape)
        assert [report["height"], report["width"]] == list(expected.shape[-2:])
        assert report["frames"] == (expected.shape[1] if expected.dim() == 5 else None)
        assert report["device_bytes_without_offload"] == weights
        if strategy == "none":
            assert result.handle is None and report["backend"] is None
            assert all(report[k] is None for k in STATS_FIELDS) and report["overlap"] is None
            return
        stats = result.handle.stats()
        assert result.handle.strategy == strategy and report["backend"] == backend.name
        assert {k: report[k] for k in STATS_FIELDS} == {k: stats[k] for k in STATS_FIELDS}
        assert stats["h2d_copies"] > 0 and stats["prefetch_misses"] == 0
        # packing only pads: the host copy holds the weights (in pinned slabs, which add their
        # alignment and unused tails), and the device peak stays below them
        assert weights <= stats["host_bytes"] <= stats["pinned_host_bytes"] == backend.pinned_memory_allocated()
        assert 0 < stats["device_peak_bytes"] <= stats["host_bytes"]
        # the timeline holds exactly the call: its copies are the counters' share of the call
        spans = result.timeline.spans()
        copies = [s for s in spans if s.kind == "copy"]
        assert sum(s.nbytes for s in copies) == report["call_h2d_bytes"] > 0
        assert all(s.lane.startswith("copy") and s.name.startswith("load ") for s in copies)
        computed = [s for s in spans if s.kind == "compute"]
        assert computed and all(s.lane == "compute" for s in computed)
        assert {f"load {s.name}" for s in computed} >= {s.name for s in copies}  # each load is for a unit that ran
        again = copy_overlap(spans, result.timeline.instants())
        assert report["copy_time_s"] == again.copy_ns / 1e9 > 0
        assert report["overlap"] == again.fraction and 0.0 <= report["overlap"] <= 1.0
    finally:
        result.close()
    assert not result.handle.enabled


def test_prefetch_depth_reaches_the_strategy():
    result = run_pipeline(parse("--pipeline", "sd3", "--prefetch-depth", "2", "--json"), backend=chaos_backend())
    try:
        assert result.report["prefetch_depth"] == 2
        streamed = [p for p in result.handle.parts if hasattr(p, "num_slots")]
        assert streamed and all(p.num_slots == 3 for p in streamed)  # depth + 1 slots
    finally:
        result.close()


def test_device_memory_lets_the_planner_choose_and_size_the_strategy(reference):
    budget = 3 * 2**20
    result = run_pipeline(parse("--device-memory", "3MiB", "--seed", str(SEED), "--json"),
                          backend=chaos_backend(device_memory=budget))
    try:
        plan = result.handle.plan
        assert plan.chosen_by == "budget" and result.report["strategy"] == plan.strategy == "layerwise"
        kept = plan.component("transformer").resident_blocks
        assert 0 < len(kept) < 24 and f"transformer {len(kept)} of 24 blocks kept" in result.report["plan"]
        assert result.report["device_peak_bytes"] <= budget
        assert torch.equal(result.output, reference("flux2-deep")[0])
    finally:
        result.close()


def test_device_memory_does_not_apply_without_offload(capsys):
    code, _, err = main(capsys, "--strategy", "none", "--device-memory", "3MiB")
    assert code == 2 and "--device-memory does not apply to --strategy none" in err


def test_the_default_demo_streams_most_of_its_weights_and_traces_them(capsys, tmp_path):
    """``offload-core run`` as the README gives it: the device peak is a small share of the
    all-resident plan, the verdict says so, and the trace has spans on both lanes."""
    trace, picture = tmp_path / "demo.json", tmp_path / "demo.png"
    code, out, _ = main(capsys, "--trace", str(trace), "--timeline", str(picture), "--json")
    assert code == 0
    report = json.loads(out)
    assert report["pipeline"] == DEFAULT_PIPELINE and report["strategy"] == "layerwise"
    saved = report["device_bytes_without_offload"] - report["device_peak_bytes"]
    assert report["device_saved_bytes"] == saved
    assert report["device_saved_fraction"] == saved / report["device_bytes_without_offload"] > 0.6
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in render(report).splitlines())
    assert table["verdict"] == report["verdict"]
    assert report["verdict"].startswith(f"device memory {report['device_saved_fraction']:.0%} lower (")
    assert table["device memory saved"].endswith(f"({report['device_saved_fraction']:.0%})")
    assert re.search(r"copies \d+% hidden behind compute", report["verdict"])
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    by_lane: dict[str, list] = {}
    for e in events:
        if e["ph"] == "X":
            by_lane.setdefault(lanes[e["tid"]], []).append(e)
    assert {"compute", "copy"} <= set(by_lane)
    blocks = {e["name"] for e in by_lane["compute"] if e["cat"] == "compute"}
    # a compute span per block, named after it: 8 double and 16 single blocks
    assert {f"transformer.transformer_blocks.{i}" for i in range(8)} <= blocks
    assert {f"transformer.single_transformer_blocks.{i}" for i in range(16)} <= blocks
    assert all(e["name"].startswith("load ") and e["args"]["bytes"] > 0 for e in by_lane["copy"])
    from PIL import Image

    image = Image.open(picture)
    assert image.format == "PNG" and image.size[0] >= 600


@pytest.mark.quick
def test_offload_that_costs_device_memory_says_higher_and_why(capsys):
    """The zoo's FLUX.2 streams a DiT whose blocks are tiny next to its slots and activations:
    the peak is above every weight resident, and the verdict says "higher", never "-9% lower"."""
    code, out, _ = main(capsys, "--pipeline", "flux2", "--json")
    report = json.loads(out)
    assert code == 0 and report["device_saved_bytes"] < 0
    added = report["device_peak_bytes"] - report["device_bytes_without_offload"]
    assert report["verdict"].startswith(
        f"device memory {-report['device_saved_fraction']:.0%} higher ({added / 1024:.2f} KiB more than every "
        "weight resident: the slots and activations outweigh the weights")
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in render(report).splitlines())
    assert "device memory saved" not in table and table["device memory added"].startswith(f"{added / 1024:.2f} KiB")
    assert "-" not in table["verdict"].split(",")[0]


@pytest.mark.quick
def test_step_times_come_from_the_denoising_loop_not_the_call(monkeypatch):
    """Prompt encoding made slow: the call's time grows by it, each step's time does not."""
    import diffusers

    encode = diffusers.Flux2Pipeline.encode_prompt

    def slow_encode(self, *args, **kwargs):
        time.sleep(0.3)
        return encode(self, *args, **kwargs)

    monkeypatch.setattr(diffusers.Flux2Pipeline, "encode_prompt", slow_encode)
    result = run_pipeline(parse("--pipeline", "flux2", "--steps", "3", "--json"), backend=chaos_backend())
    try:
        report = result.report
        assert report["wall_time_s"] > 0.3 and len(report["step_times_s"]) == 3
        assert max(report["step_times_s"]) < 0.3 and report["step_s"] < report["wall_time_s"] / 3
        assert len(result.measured.step_ends_ms) == 3 and result.measured.memory_ms
    finally:
        result.close()


def test_without_a_step_callback_the_steps_come_from_the_denoiser_forwards(monkeypatch):
    from offload_core.cli.run import clock

    monkeypatch.setattr(clock, "takes_step_callback", lambda pipe: False)
    result = run_pipeline(parse("--pipeline", "flux2", "--steps", "3", "--json"), backend=chaos_backend())
    try:
        steps = result.report["step_times_s"]
        assert len(steps) == 3 and all(t > 0 for t in steps) and sum(steps) < result.report["wall_time_s"]
    finally:
        result.close()


def test_prefetches_for_a_step_that_never_comes_are_counted_apart():
    """Each copy the report counts as used loads a unit that computed after it; the others are
    the unused ones, and both add up to the call's copies."""
    result = run_pipeline(parse("--pipeline", "flux2", "--steps", "2", "--json"), backend=chaos_backend())
    try:
        report, spans = result.report, result.timeline.spans()
        copies = [s for s in spans if s.kind == "copy"]
        used = [c for c in copies if any(s.kind == "compute" and s.name == c.name[len("load "):]
                                         and s.start_ns > c.start_ns for s in spans)]
        assert report["unused_prefetch_copies"] == len(copies) - len(used)
        assert report["unused_prefetch_bytes"] == sum(c.nbytes for c in copies) - sum(c.nbytes for c in used)
        assert len(copies) == report["call_h2d_copies"]
    finally:
        result.close()


def test_unused_prefetches_are_found_in_a_timeline():
    from offload_core.cli.run.report import unused_prefetches
    from offload_core.common.timeline import Span

    class Recorded:
        def spans(self):
            return [Span("copy", "load b0", "copy", 0, 1, 10), Span("compute", "b0", "compute", 2, 3, 0),
                    Span("copy", "load b1", "copy", 2, 3, 20), Span("compute", "b1", "compute", 4, 5, 0),
                    Span("copy", "load b0", "copy", 4, 5, 10)]  # b0 again, for a forward that never comes

    assert unused_prefetches(Recorded()) == (1, 10)


@pytest.mark.quick
def test_times_from_the_fake_say_they_are_simulated_and_compare_runs_without_offload(capsys):
    code, out, _ = main(capsys, "--pipeline", "flux2", "--steps", STEPS, "--compare")
    assert code == 0
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in out.splitlines())
    for row in ("time per step", "call", "without offload", "verdict"):  # before a busy machine's clause
        assert sample.UNRELIABLE_CLAUSE.sub("", table[row]).endswith("simulated on the CPU (fake backend)"), row
    assert table["backend"] == "fake (a simulator on the CPU)"
    assert re.fullmatch(r"call \S+ m?s; offloaded / without: \d+\.\d\dx; same output: yes; .*", table["without offload"])
    code, out, _ = main(capsys, "--pipeline", "flux2", "--steps", STEPS, "--compare", "--json")
    compare = json.loads(out)["compare"]
    assert compare["same_output"] is True
    assert compare["cost_ratio"] == pytest.approx(json.loads(out)["wall_time_s"] / compare["call_s_without_offload"])


def test_an_accelerator_backend_is_not_called_simulated():
    from offload_core_fake import FakeBackend

    class Accelerator(FakeBackend):
        is_accelerator = True

    result = run_pipeline(parse("--pipeline", "flux2", "--json"), backend=Accelerator())
    try:
        assert result.report["simulated"] is False and "simulated" not in render(result.report)
    finally:
        result.close()


def test_trace_has_a_copy_lane_per_copy_stream(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    # two expert DiTs, each streamed on its own copy stream
    code, out, _ = main(capsys, "--pipeline", "wan2.2-t2v", "--strategy", "layerwise", "--steps", STEPS,
                        "--trace", str(trace), "--json")
    assert code == 0 and json.loads(out)["trace"] == str(trace)
    events = json.loads(trace.read_text())["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    copy_rows = {rows[e["tid"]]: e for e in events if e["ph"] == "X" and e["cat"] == "copy"}
    assert set(copy_rows) == {"copy", "copy 2"}
    loaded = {e["name"].split(".")[0] for e in events if e["ph"] == "X" and e["cat"] == "copy"}
    assert loaded == {"load transformer", "load transformer_2"}  # blocks named after their component


def test_a_backend_without_timing_events_reports_the_overlap_as_unknown():
    """The trace still has both lanes (in host time), but host times cannot say what was hidden."""
    from offload_core import Capability
    from offload_core_fake import FakeBackend

    class Untimed(FakeBackend):
        capabilities = FakeBackend.capabilities - {Capability.TIMING}

    result = run_pipeline(parse("--pipeline", "flux2", "--json"), backend=Untimed(chaos=True, chaos_delay=0.001))
    try:
        report = result.report
        assert report["device_timed"] is False and report["overlap"] is None and report["copy_time_s"] is None
        assert "copy overlap unknown (fake has no device timing)" in report["verdict"]
        assert {s.kind for s in result.timeline.spans()} == {"compute", "wait", "copy"}
    finally:
        result.close()


def test_timeline_without_matplotlib_is_bad_input(capsys, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    monkeypatch.setattr(loading, "load", _no_work)
    code, out, err = main(capsys, "--timeline", str(tmp_path / "t.png"))
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert "--timeline needs matplotlib" in err and "offload-core[plot]" in err
    assert list(tmp_path.iterdir()) == []


def test_output_png_has_the_requested_size_and_the_pixels(capsys, tmp_path, reference):
    from PIL import Image

    path = tmp_path / "cat.png"
    code, out, _ = main(capsys, "--pipeline", "sd3", "--seed", str(SEED), "--height", "16", "--width", "32",
                        "--output", str(path), "--json")
    assert code == 0 and json.loads(out)["output_files"] == [str(path)]
    image = Image.open(path)
    assert image.format == "PNG" and image.size == (32, 16) and image.mode == "RGB"
    # the same pixels as the run without offload, up to 8-bit rounding
    expected = build_pipeline("sd3").run(seed=SEED, height=16, width=32)[0].permute(1, 2, 0)
    decoded = torch.from_numpy(np.array(image)).float() / 255
    assert (decoded - expected.clamp(0, 1)).abs().max() <= 0.5 / 255 + 1e-6


def test_video_output_is_one_png_per_frame(capsys, tmp_path):
    from PIL import Image

    code, out, _ = main(capsys, "--pipeline", "wan2.2-t2v", "--frames", "9", "--output", str(tmp_path / "clip.png"),
                        "--json")
    report = json.loads(out)
    assert code == 0 and report["frames"] == 9
    expected = [str(tmp_path / f"clip_{i:04d}.png") for i in range(9)]
    assert report["output_files"] == expected and sorted(map(str, tmp_path.iterdir())) == expected
    assert {Image.open(p).size for p in expected} == {(report["width"], report["height"])}


def test_a_frame_name_taken_by_a_directory_is_bad_input_and_nothing_is_written(capsys, tmp_path):
    """How many frames there are is known only after the run: a directory with a frame's name is
    refused then, before any file is written, and is left where it was (never moved aside)."""
    taken = tmp_path / "v_0002.png"
    taken.mkdir()
    (taken / "keep.txt").write_text("the user's")
    code, out, err = main(capsys, "--pipeline", "wan2.2-t2v", "--frames", "5", "--output", str(tmp_path / "v.png"),
                          "--trace", str(tmp_path / "t.json"), "--json")
    assert (code, out) == (2, "")
    assert err == f"offload-core: error: {str(taken)!r} is a directory, so it cannot take an output file; " \
                  "no file was written\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v_0002.png"] and (taken / "keep.txt").read_text() == "the user's"


@pytest.fixture(scope="module")
def saved_sd3(tmp_path_factory) -> Path:
    """SD3 saved with save_pretrained (LongCat-Image and JoyImage-Edit do not round-trip: their
    processors fail to save)."""
    path = tmp_path_factory.mktemp("sd3")
    build_pipeline("sd3").pipe.save_pretrained(path)
    return path


def test_model_folder_runs_and_offload_does_not_change_the_image(capsys, saved_sd3):
    argv = ["--model", str(saved_sd3), "--steps", STEPS, "--height", "16", "--width", "16", "--seed", str(SEED)]
    code, out, _ = main(capsys, *argv, "--json")
    report = json.loads(out)
    assert code == 0
    assert report["pipeline_class"] == "StableDiffusion3Pipeline" and report["model"] == str(saved_sd3)
    assert (report["steps"], report["height"], report["width"]) == (int(STEPS), 16, 16)
    plain = run_pipeline(parse(*argv, "--strategy", "none", "--json"))
    streamed = run_pipeline(parse(*argv, "--json"), backend=chaos_backend())
    try:
        assert torch.equal(streamed.output, plain.output)
        assert streamed.report["h2d_copies"] == streamed.handle.stats()["h2d_copies"] > 0
    finally:
        streamed.close()


def _no_work(*args, **kwargs):
    raise AssertionError("bad input was found only after work started")


def _corrupt_copy(saved: Path, tmp: Path) -> Path:
    """``saved`` with one weight file truncated."""
    import shutil

    corrupt = tmp / "corrupt"
    if not corrupt.exists():
        shutil.copytree(saved, corrupt)
        weights = sorted(corrupt.rglob("*.safetensors"))[0]
        weights.write_bytes(weights.read_bytes()[:100])
    return corrupt


def _index_edited(saved: Path, tmp: Path, name: str, edit) -> Path:
    import shutil

    folder = tmp / name
    if not folder.exists():
        shutil.copytree(saved, folder)
        index = json.loads((folder / "model_index.json").read_text())
        edit(index)
        (folder / "model_index.json").write_text(json.dumps(index))
    return folder


def _bad_inputs(tmp: Path, saved: Path) -> list[tuple[list[str], str]]:
    """Bad input found before anything is built or loaded: (argv, what the message says)."""
    (tmp / "empty").mkdir(exist_ok=True)
    (tmp / "a-directory.png").mkdir(exist_ok=True)
    bogus = _index_edited(saved, tmp, "bogus", lambda index: index.update(_class_name="NoSuchPipeline"))
    bad_part = _index_edited(saved, tmp, "bad-part", lambda index: index.update(vae=["diffusers", "NoSuchVAE"]))
    unwritable = "/proc/offload-core-test.png"
    return [
        (["--pipeline", "nope"], "unknown pipeline 'nope'"),
        (["--model", str(tmp / "missing")], "no such file or directory; --model takes a local diffusers folder"),
        (["--model", "black-forest-labs/FLUX.2-dev"],
         "huggingface-cli download black-forest-labs/FLUX.2-dev --local-dir FLUX.2-dev, then --model FLUX.2-dev"),
        (["--model", str(tmp / "empty")], "model_index.json"),
        (["--model", str(bogus)], "names 'NoSuchPipeline', which is not a diffusers pipeline class"),
        (["--model", str(bad_part)], "component 'vae' the class diffusers.NoSuchVAE, which cannot be imported"),
        (["--model", str(_corrupt_copy(saved, tmp))], "is not a valid safetensors file"),
        (["--pipeline", "flux2", "--frames", "5"], "--frames does not apply to Flux2Pipeline"),
        (["--model", str(saved), "--frames", "5"], "--frames does not apply to StableDiffusion3Pipeline"),
        (["--steps", "0"], f"argument --steps: must be between 1 and {MAX_STEPS}, got 0"),
        (["--steps", str(2**31)], f"argument --steps: must be between 1 and {MAX_STEPS}"),
        (["--seed", str(2**64)], "argument --seed: must be between 0 and"),
        (["--width", "-16"], "argument --width: must be between 1 and"),
        (["--backend", "nope"], "registered backends:"),
        (["--strategy", "none", "--backend", "fake"], "--backend does not apply to --strategy none"),
        (["--strategy", "none", "--timeline", str(tmp / "t.png")], "--timeline does not apply to --strategy none"),
        (["--strategy", "model", "--prefetch-depth", "2"], "--prefetch-depth applies to --strategy layerwise"),
        (["--strategy", "none", "--compare"], "--compare does not apply to --strategy none"),
        (["--output", str(tmp / "x.jpg")], "--output must name a .png file"),
        (["--timeline", str(tmp / "x.svg")], "--timeline must name a .png file"),
        (["--trace", str(tmp / "no" / "t.json")], "does not exist"),
        (["--trace", str(tmp / "empty")], "is a directory"),
        (["--output", str(tmp / "a-directory.png")], "is a directory"),
        (["--output", unwritable], "cannot write in '/proc'"),
        (["--trace", str(tmp / "same.png"), "--timeline", str(tmp / "same.png")], "must name different files"),
        (["--output", str(tmp / "v.png"), "--timeline", str(tmp / "v_0000.png")],
         "--timeline '%s' has the name of a frame of --output" % (tmp / "v_0000.png")),
        (["--pipeline", "sd3", "--model", str(saved)], "not allowed with argument"),
    ]


@pytest.mark.quick
def test_bad_input_is_one_line_and_exit_2_before_any_work(capsys, tmp_path, saved_sd3, monkeypatch):
    cases = _bad_inputs(tmp_path, saved_sd3)
    before = sorted(tmp_path.rglob("*"))
    import diffusers
    import offload_core.tiny

    monkeypatch.setattr(offload_core.tiny, "build_pipeline", _no_work)
    monkeypatch.setattr(diffusers.DiffusionPipeline, "from_pretrained", _no_work)
    for argv, problem in cases:
        code, out, err = main(capsys, *argv)
        lines = err.strip().splitlines()
        assert (code, out, len(lines)) == (2, "", 1), (argv, err)
        assert lines[0].startswith("offload-core: error: ") and problem in lines[0], (argv, lines[0])
        if "--backend" in argv and "nope" in argv:
            assert "fake" in lines[0]  # the registered names are listed
    assert sorted(tmp_path.rglob("*")) == before  # no file was written


def test_a_backend_variable_that_does_not_parse_is_bad_input_before_any_work(capsys, monkeypatch):
    import offload_core.tiny

    monkeypatch.setattr(offload_core.tiny, "build_pipeline", _no_work)
    monkeypatch.setattr(registry(), "_instances", {})  # as in a fresh process: no shared fake made yet
    monkeypatch.setenv("OFFLOAD_CORE_FAKE_DEVICE_MEMORY", "abc")
    code, out, err = main(capsys, "--backend", "fake")
    assert (code, out, err.count("\n")) == (2, "", 1)
    assert "invalid environment variable OFFLOAD_CORE_FAKE_DEVICE_MEMORY='abc'" in err


@pytest.mark.parametrize(
    "argv, problem",
    [
        (["--pipeline", "flux2", "--height", "7"], "--height 7: Flux2Pipeline needs a multiple of 4"),
        (["--pipeline", "wan2.2-t2v", "--height", "24"], "WanPipeline rejected the input"),
    ],
)
def test_sizes_the_pipeline_cannot_take_are_bad_input_and_write_nothing(capsys, tmp_path, argv, problem):
    out_file = tmp_path / "x.png"
    code, out, err = main(capsys, *argv, "--output", str(out_file), "--trace", str(tmp_path / "t.json"))
    assert (code, out, err.count("\n")) == (2, "", 1) and problem in err, err
    assert list(tmp_path.iterdir()) == []


def test_a_size_the_pipeline_rounds_silently_is_caught_after_the_call(capsys, tmp_path, monkeypatch):
    """Where the pipeline does not say which sizes it takes, the output size is checked instead."""
    monkeypatch.setattr(loading, "size_multiple", lambda pipe: None)
    code, out, err = main(capsys, "--pipeline", "flux2", "--height", "7", "--output", str(tmp_path / "x.png"))
    assert (code, out) == (2, "") and "--height 7: Flux2Pipeline made an output 4 pixels in height" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.quick
def test_a_failed_write_leaves_no_file_behind(capsys, tmp_path, monkeypatch):
    """The trace is written before the image fails: neither is left, and the error is one line."""
    from PIL import Image

    def broken_save(self, *args, **kwargs):
        raise OSError("No space left on device")

    monkeypatch.setattr(Image.Image, "save", broken_save)
    code, out, err = main(capsys, "--pipeline", "sd3", "--trace", str(tmp_path / "t.json"),
                          "--output", str(tmp_path / "x.png"), "--json")
    assert (code, out, err) == (1, "", "offload-core: error: OSError: No space left on device\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.quick
def test_a_failed_rename_puts_back_what_was_there(capsys, tmp_path, monkeypatch):
    """The last rename fails: the files renamed before it are taken back and the file one of them
    replaced is restored, so the folder is as it was before the run."""
    old_trace = tmp_path / "t.json"
    old_trace.write_text("the previous run's trace")
    real_replace = os.replace

    def failing_replace(source, target):
        if Path(target).name == "x.png":
            raise OSError("Input/output error")
        real_replace(source, target)

    monkeypatch.setattr(os, "replace", failing_replace)
    code, out, err = main(capsys, "--pipeline", "sd3", "--trace", str(old_trace), "--output", str(tmp_path / "x.png"),
                          "--json")
    assert (code, out, err) == (1, "", "offload-core: error: OSError: Input/output error\n")
    assert list(tmp_path.iterdir()) == [old_trace] and old_trace.read_text() == "the previous run's trace"


def test_a_failing_run_is_one_line_and_exit_1_and_debug_adds_the_traceback(capsys, monkeypatch):
    import offload_core.tiny

    def broken(name, seed=0):
        raise RuntimeError("the model exploded\nsecond line")

    monkeypatch.setattr(offload_core.tiny, "build_pipeline", broken)
    code, out, err = main(capsys, "--pipeline", "sd3")
    assert (code, out, err) == (1, "", "offload-core: error: RuntimeError: the model exploded\n")
    code, _, err = main(capsys, "--pipeline", "sd3", "--debug")
    assert code == 1 and "Traceback" in err and err.rstrip().endswith("RuntimeError: the model exploded")


def test_pipeline_list(capsys):
    code, out, _ = main(capsys, "--pipeline", "list")
    assert code == 0
    assert [line.split()[:2] for line in out.splitlines()] == [[n, s.cls_name] for n, s in embedded().items()]
    assert DEFAULT_PIPELINE in embedded() and set(PIPELINES) < set(embedded())
    code, out, _ = main(capsys, "--pipeline", "list", "--json")
    assert [row["name"] for row in json.loads(out)] == list(embedded())


def test_console_script_prints_the_table(tmp_path):
    script = Path(sys.executable).with_name("offload-core")
    assert script.exists(), "the package is not installed with its console script"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", ENV_BACKEND: "fake"}
    done = subprocess.run(
        [str(script), "run", "--pipeline", "sd3", "--strategy", "layerwise", "--steps", STEPS],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in done.stdout.splitlines())
    assert table["pipeline"] == "sd3 (StableDiffusion3Pipeline)"
    assert table["strategy"].startswith("layerwise") and table["backend"] == "fake (a simulator on the CPU)" and table["steps"] == STEPS
    assert table["prefetch misses"] == "0" and table["overlap (copy hidden)"].endswith(")")


@pytest.mark.quick
def test_a_plain_run_prints_no_warning(tmp_path):
    """``offload-core run`` as the README gives it, in the test environment (torchao installed,
    which transformers imports and which warns that its C++ kernels were built for another torch):
    stderr holds the progress bars and the one line saying the simulator stands in, nothing else."""
    script = Path(sys.executable).with_name("offload-core")
    env = {k: v for k, v in os.environ.items() if k != ENV_BACKEND}
    done = subprocess.run([str(script), "run"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert done.returncode == 0, done.stderr
    lines = [line for line in re.split(r"[\r\n]", done.stderr) if line.strip() and "it/s]" not in line]
    assert lines == ["no accelerator backend is available; falling back to the simulator 'fake'"], done.stderr


@pytest.mark.quick
def test_the_demo_reports_a_steady_state_over_its_later_steps_and_says_when_it_cannot_vouch(monkeypatch):
    """The overlap per step, from the timeline cut at the host's step marks; the verdict gives the
    median and range of steps 2-8; a machine with more runnable work than cores makes the verdict
    say "unreliable (machine busy)" and why, as ``offload-core bench`` does."""
    from offload_core.cli.run import steady

    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 64.0, 64.0))
    result = run_pipeline(parse("--json"), backend=chaos_backend())
    try:
        report = result.report
        assert report["steps"] == DEMO_STEPS and len(report["overlap_steps"]) == DEMO_STEPS
        later = [f for f in report["overlap_steps"][1:] if f is not None]
        assert all(0.0 <= f <= 1.0 for f in later) and len(later) >= 2
        s = report["steady_overlap"]
        assert (s["median"], s["low"], s["high"], s["steps"]) == (
            statistics.median(later), min(later), max(later), [2, DEMO_STEPS])
        assert f"copies {s['median']:.0%} hidden behind compute ({s['low']:.0%} to {s['high']:.0%} over steps " \
               f"2-{DEMO_STEPS})" in report["verdict"]
        assert report["unreliable"][0] == f"load average 64.00 on {os.cpu_count()} cores"
        assert f"; unreliable (machine busy): load average 64.00 on {os.cpu_count()} cores" in report["verdict"]
    finally:
        result.close()


def test_what_makes_a_run_unreliable():
    from offload_core.cli.run.steady import Steady, unreliable_reasons

    narrow, wide = Steady(0.05, 0.03, 0.07, 2, 8), Steady(0.2, 0.01, 0.4, 2, 8)  # shares of copy time waited for
    steps, jumpy = Steady(0.03, 0.029, 0.031, 2, 8), Steady(0.03, 0.02, 0.09, 2, 8)
    assert unreliable_reasons(None, narrow, steps, (1.3, 0.05)) == []
    assert unreliable_reasons(None, wide, steps, None) == [
        "the share of copy time compute waited for ranges over 39 points across steps 2-8"]
    assert unreliable_reasons(None, narrow, jumpy, None) == ["the step times range over 233% of their median"]
    # an offloaded run faster than the resident one beyond the spread: the timing is broken (bench's floor)
    assert unreliable_reasons(None, narrow, steps, (0.46, 0.1)) == [
        "the offloaded steps came out faster than those without offload (0.46x, beyond its spread)"]
    assert unreliable_reasons(None, narrow, steps, (0.95, 0.1)) == []  # within its spread of 1
    assert Steady.of([0.5, 0.75, None, 0.25]) == Steady(0.5, 0.25, 0.75, 2, 4)
    assert Steady.of([0.5, 0.9]) is None  # one later step: no range to give


@pytest.mark.quick
def test_a_garbage_collection_inside_a_step_is_named_and_not_a_busy_machine(monkeypatch):
    """A collection forced at the start of step 4, made to last 0.3 s (a callback of ours that
    sleeps as it ends, as a full collection of a big process lasts): the report names it, the
    step's time shown leaves it out, and the step times' range does not call the run unreliable."""
    import gc

    from offload_core.cli.run.clock import StepClock
    from offload_core.cli.run.steady import Steady, unreliable_reasons

    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    forcing = []

    def slow_collection(phase, info):
        if phase == "stop" and forcing:
            time.sleep(0.3)

    step_end = StepClock.on_step_end

    def collect_after_step_3(self, pipe, step, timestep, callback_kwargs):
        kept = step_end(self, pipe, step, timestep, callback_kwargs)
        if step == 2:  # the third step ended: this collection is inside the fourth
            forcing.append(True)
            gc.collect()
            forcing.clear()
        return kept

    monkeypatch.setattr(StepClock, "on_step_end", collect_after_step_3)
    gc.callbacks.append(slow_collection)
    try:
        result = run_pipeline(parse("--json"), backend=offload_core.get_backend("fake", chaos=False))
    finally:
        gc.callbacks.remove(slow_collection)
    try:
        report = result.report
        assert report["step_times_s"][3] >= 0.3 and report["collected_s"][3] >= 0.3
        assert max(report["collected_s"][:3] + report["collected_s"][4:]) < 0.3
        # the steady figure and the run's reliability are judged on the steps less their collections
        net = [t - c for t, c in zip(report["step_times_s"], report["collected_s"])]
        assert report["steady_step_s"] == Steady.of(net).to_dict()
        waited = Steady(**{k: report["steady_waited"][k] for k in ("median", "low", "high")},
                        first_step=2, last_step=DEMO_STEPS) if report["steady_waited"] else None
        assert report["unreliable"] == (unreliable_reasons(None, waited, Steady.of(net), None) or None)
        table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in render(report).splitlines())
        assert re.search(r"Python's garbage collector held (step \d for \S+ m?s, )*step 4 for 3\d\d\.\d ms"
                         r"( |, step \d for \S+ m?s)*\(left out of these times\)",
                         table["time per step"]), table["time per step"]
    finally:
        result.close()


def test_the_call_runs_with_the_loaded_objects_frozen_out_of_collections(monkeypatch):
    """A full collection walks every object the process tracks; the ones alive before the call
    are frozen out of them while it runs, and given back after."""
    import gc

    from offload_core.cli.run.clock import StepClock

    frozen = []
    step_end = StepClock.on_step_end

    def count_frozen(self, *args):
        frozen.append(gc.get_freeze_count())
        return step_end(self, *args)

    monkeypatch.setattr(StepClock, "on_step_end", count_frozen)
    before = gc.get_freeze_count()
    result = run_pipeline(parse("--pipeline", "flux2", "--json"), backend=chaos_backend())
    result.close()
    assert frozen and min(frozen) > before + 100_000  # the pipeline and the libraries
    assert gc.get_freeze_count() == before


def test_a_first_model_level_call_counts_copies_beside_idle_compute_as_not_hidden():
    """The first group's copy runs before anything computes: it hides behind nothing, though
    compute never waited for it. The figure is the copy time under compute spans, less waits."""
    from offload_core.common.overlap import difference, intersect, length, union

    result = run_pipeline(parse("--pipeline", "flux2", "--strategy", "model", "--json"), backend=chaos_backend())
    try:
        report, spans = result.report, result.timeline.spans()
        copies = union((s.start_ns, s.end_ns) for s in spans if s.kind == "copy")
        computing = union((s.start_ns, s.end_ns) for s in spans if s.kind == "compute")
        waits = union((s.start_ns, s.end_ns) for s in spans if s.kind == "wait")
        first = min((s for s in spans if s.kind == "copy"), key=lambda s: s.start_ns)
        assert not intersect([(first.start_ns, first.end_ns)], computing)  # nothing computed beside it
        hidden = length(intersect(copies, difference(computing, waits)))
        assert report["overlap"] == pytest.approx(hidden / length(copies)) and report["overlap"] < 1.0
        assert report["exposed_copy_time_s"] >= (first.end_ns - first.start_ns) / 1e9 > 0
    finally:
        result.close()


def test_a_resident_run_does_not_explain_its_memory_by_slots(capsys):
    """A budget every weight fits in: the planner keeps the pipeline resident, and the peak above
    every weight is the call's activations, not slots the run does not have."""
    code, out, _ = main(capsys, "--device-memory", "1GiB", "--json")
    report = json.loads(out)
    assert code == 0 and report["strategy"] == "resident" and report["device_saved_bytes"] < 0
    assert "slot" not in render(report)
    assert "the plan keeps every weight on the device, and the call's activations come on top" in report["verdict"]


def test_the_sample_comparison_drops_the_garbage_collections_of_the_step_row():
    """A collection of a millisecond or more lands in some runs and not others: the pages'
    samples are compared without it, as without a busy machine's clause."""
    row = ("time per step   44.1 ms (median of steps 2-8, 43.3 ms to 45.7 ms), first step 49.5 ms; Python's garbage "
           "collector held step 4 for 1.2 ms, step 6 for 3.0 ms (left out of these times); simulated on the CPU")
    assert sample.masked(row) == ("time per step   # (median of steps #-#, # to #), first step #; simulated on the CPU")
