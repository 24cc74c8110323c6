"""``offload-core run``: every embedded pipeline under every strategy gives the image of a run
without offload, the report repeats the handle's own counters, the files it writes are readable,
and bad input is one line on stderr with exit status 2."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from offload_core import cli
from offload_core.cli_run import STRATEGIES, run_pipeline
from offload_core.overlap import copy_overlap
from offload_core.plugins import ENV_BACKEND
from offload_core.tiny import PIPELINES, build_pipeline

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


@pytest.fixture(autouse=True)
def no_env_override(monkeypatch):
    monkeypatch.delenv(ENV_BACKEND, raising=False)


@pytest.fixture(scope="module", autouse=True)
def library_warnings_already_shown():
    """Import every pipeline class once, outside any test's captured stderr: transformers warns
    once per process about optional packages (torchvision), and that line is not the command's."""
    import diffusers

    for spec in PIPELINES.values():
        getattr(diffusers, spec.cls_name)


@pytest.fixture(scope="module")
def reference():
    """Per pipeline name: the output of the tiny pipeline without offload, same seed, and its weight bytes."""
    cache: dict[str, tuple[torch.Tensor, int]] = {}

    def get(name: str) -> tuple[torch.Tensor, int]:
        if name not in cache:
            tiny = build_pipeline(name)
            storages: dict[int, int] = {}
            for module in tiny.pipe.components.values():
                if isinstance(module, torch.nn.Module):
                    for _, t in [*module.named_parameters(), *module.named_buffers()]:
                        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            cache[name] = (tiny.run(seed=SEED), sum(storages.values()))
        return cache[name]

    return get


def main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def parse(*argv: str):
    return cli.build_parser().parse_args(["run", *argv])


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("name", list(PIPELINES))
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
        assert report["wall_time_per_step_s"] == pytest.approx(report["wall_time_s"] / int(STEPS))
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
        spans = backend.timeline.spans()
        copies = [s for s in spans if s.name == "H2D"]
        assert sum(s.nbytes for s in copies) == report["call_h2d_bytes"] > 0
        assert len(copies) == report["call_h2d_copies"] <= stats["h2d_copies"]
        again = copy_overlap(spans)
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


def test_trace_has_a_row_per_copy_stream(capsys, tmp_path):
    trace = tmp_path / "trace.json"
    # two expert DiTs, each streamed on its own copy stream
    code, out, _ = main(capsys, "--pipeline", "wan2.2-t2v", "--strategy", "layerwise", "--steps", STEPS,
                        "--trace", str(trace), "--json")
    assert code == 0 and json.loads(out)["trace"] == str(trace)
    events = json.loads(trace.read_text())["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    spans = [e for e in events if e["ph"] == "X"]
    assert len({e["tid"] for e in spans}) >= 2
    copy_rows = {rows[e["tid"]] for e in spans if e["name"] == "H2D"}
    assert len(copy_rows) >= 2 and all(r.startswith("stream-") for r in copy_rows)


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


def _bad_inputs(tmp: Path, saved: Path) -> list[tuple[list[str], str]]:
    (tmp / "empty").mkdir(exist_ok=True)
    return [
        (["--pipeline", "nope"], "unknown pipeline 'nope'"),
        (["--model", str(tmp / "missing")], "no such file or directory"),
        (["--model", str(tmp / "empty")], "model_index.json"),
        (["--pipeline", "flux2", "--frames", "5"], "--frames does not apply to Flux2Pipeline"),
        (["--model", str(saved), "--frames", "5"], "--frames does not apply to StableDiffusion3Pipeline"),
        (["--steps", "0"], "argument --steps: must be >= 1, got 0"),
        (["--width", "-16"], "argument --width: must be >= 1"),
        (["--pipeline", "sd3", "--height", "17"], "rejected the input"),
        (["--backend", "nope"], "registered backends:"),
        (["--strategy", "none", "--backend", "fake"], "--backend does not apply to --strategy none"),
        (["--strategy", "model", "--prefetch-depth", "2"], "--prefetch-depth applies to --strategy layerwise"),
        (["--output", str(tmp / "x.jpg")], "--output must name a .png file"),
        (["--trace", str(tmp / "no" / "t.json")], "does not exist"),
        (["--pipeline", "sd3", "--model", str(saved)], "not allowed with argument"),
    ]


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path, saved_sd3):
    for argv, problem in _bad_inputs(tmp_path, saved_sd3):
        code, out, err = main(capsys, *argv)
        lines = err.strip().splitlines()
        assert (code, out, len(lines)) == (2, "", 1), (argv, err)
        assert lines[0].startswith("offload-core: error: ") and problem in lines[0], (argv, lines[0])
        if "--backend" in argv and "nope" in argv:
            assert "fake" in lines[0]  # the registered names are listed


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
    assert [line.split()[:2] for line in out.splitlines()] == [[n, s.cls_name] for n, s in PIPELINES.items()]
    code, out, _ = main(capsys, "--pipeline", "list", "--json")
    assert [row["name"] for row in json.loads(out)] == list(PIPELINES)


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
    assert table["strategy"].startswith("layerwise") and table["backend"] == "fake" and table["steps"] == STEPS
    assert table["prefetch misses"] == "0" and table["overlap (copy hidden)"].endswith(")")
