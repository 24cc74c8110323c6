"""``offload-core plan``: the text and JSON of a plan for an embedded tiny pipeline and a real-size
one, the same plan as the planner's, bad input as one line and exit status 2, and the docs table."""

from __future__ import annotations

import json
import os

import pytest

from offload_core.cli import main

pytestmark = pytest.mark.quick


def plan_json(capsys, *argv: str) -> dict:
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_a_tiny_pipeline_under_a_tight_budget_streams_its_dit(capsys):
    data = plan_json(capsys, "--pipeline", "flux2-deep", "--device-memory", "2MiB", "--block-compute-ms", "1")
    assert (data["strategy"], data["chosen_by"], data["budget"]) == ("layerwise", "budget", 2 * 2**20)
    dit = next(c for c in data["components"] if c["name"] == "transformer")
    assert dit["mode"] == "streamed" and dit["copies_per_forward"] == len(dit["streamed_blocks"]) > 0
    assert sorted(dit["resident_blocks"] + dit["streamed_blocks"]) == list(range(24))
    assert data["device_peak"] <= data["budget"] and dit["ratio"] >= 1.0
    assert data["bandwidth"] == 25e9


def test_the_text_says_the_same_plan(capsys):
    assert main(["plan", "--pipeline", "flux2-deep", "--device-memory", "2MiB"]) == 0
    text = capsys.readouterr().out
    data = plan_json(capsys, "--pipeline", "flux2-deep", "--device-memory", "2MiB")
    dit = next(c for c in data["components"] if c["name"] == "transformer")
    assert text.startswith("budget 2.0 MiB: layerwise offload, chosen by the budget")
    assert f"transformer (dit): {len(dit['resident_blocks'])} of 24 blocks resident" in text
    assert f"per forward      {dit['copies_per_forward']} copies" in text
    assert "block compute time unknown: no predicted ratio" in text


def test_a_large_budget_keeps_everything_resident_and_a_flag_keeps_its_strategy(capsys):
    assert plan_json(capsys, "--device-memory", "1GiB")["strategy"] == "resident"
    forced = plan_json(capsys, "--device-memory", "1GiB", "--strategy", "layerwise", "--resident-blocks", "5")
    assert forced["chosen_by"] == "flag"
    assert len(next(c for c in forced["components"] if c["name"] == "transformer")["resident_blocks"]) == 5


def test_a_given_activation_memory_replaces_the_estimate(capsys):
    assert plan_json(capsys, "--device-memory", "5.65MiB")["strategy"] == "layerwise"  # 5.6 MiB of weights + estimate
    given = plan_json(capsys, "--device-memory", "5.65MiB", "--activation-memory", "0")
    assert given["strategy"] == "resident"
    assert {c["activation_source"] for c in given["components"]} == {"given"}


def test_host_budgets_and_bandwidth_reach_the_plan(capsys):
    data = plan_json(capsys, "--device-memory", "2MiB", "--host-memory", "4MiB", "--pinned-memory", "3MiB",
                     "--bandwidth", "10")
    hosts = [c["host"] for c in data["components"]]
    assert sum(h.get("disk", 0) for h in hosts) > 0 and 0 < sum(h.get("pinned", 0) for h in hosts) <= 3 * 2**20
    assert data["bandwidth"] == 10e9 and data["bandwidth_source"] == "--bandwidth"


def test_a_real_size_pipeline_plans_without_weights(capsys):
    data = plan_json(capsys, "--pipeline", "real:wan2.2-t2v-a14b", "--device-memory", "24GiB")
    assert data["strategy"] == "layerwise" and data["device_peak"] <= 24 * 2**30
    dits = [c for c in data["components"] if c["kind"] == "dit"]
    assert [c["name"] for c in dits] == ["transformer", "transformer_2"]
    assert all(0 < len(c["resident_blocks"]) < 40 for c in dits)


def test_a_local_folder_plans_as_its_pipeline_built_in_code(capsys, tmp_path):
    from offload_core.tiny import build_pipeline

    build_pipeline("flux2-deep").pipe.save_pretrained(tmp_path)
    from_folder = plan_json(capsys, "--model", str(tmp_path), "--device-memory", "2MiB")
    built = plan_json(capsys, "--pipeline", "flux2-deep", "--device-memory", "2MiB")
    assert from_folder == built
    assert main(["plan", "--model", str(tmp_path / "missing"), "--device-memory", "2MiB"]) == 2
    assert "no such file or directory" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--device-memory", "1KiB"], "the smallest budget that works is"),
    (["--device-memory", "lots"], "argument --device-memory: expected bytes"),
    (["--device-memory", "24G"], "'G' is ambiguous"),
    (["--device-memory", "24"], "'24' has no unit: write '24GiB'"),
    (["--device-memory", "0.5"], "fraction of the device's memory, which is unknown"),
    (["--device-memory", "1GiB", "--pipeline", "nope"], "unknown pipeline 'nope'"),
    (["--device-memory", "1GiB", "--resident-blocks", "x"], "expected 'auto' or an integer"),
    (["--device-memory", "1GiB", "--host-memory", "2.5"], "a fraction of RAM is in (0, 1], got '2.5'"),
    (["--device-memory", "1GiB", "--activation-memory", "0.5"], "'0.5' has no unit"),
    (["--device-memory", "1GiB", "--block-compute-ms", "inf"], "expected a finite number > 0, got inf"),
    (["--device-memory", "1GiB", "--block-compute-ms", "nan"], "expected a finite number > 0, got nan"),
    (["--device-memory", "1GiB", "--block-compute-ms", "-1"], "expected a finite number > 0, got -1"),
    (["--device-memory", "1GiB", "--bandwidth", "inf"], "expected a finite number > 0, got inf"),
    (["--device-memory", "1GiB", "--bandwidth=-inf"], "expected a finite number > 0, got -inf"),
    (["--device-memory", "1GiB", "--strategy", "model", "--resident-blocks", "2"], "not to model-level"),
    ([], "--device-memory SIZE is required"),
])
def test_bad_input_is_one_line_and_status_2(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_list_names_the_tiny_and_the_real_size_pipelines(capsys):
    assert main(["plan", "--pipeline", "list"]) == 0
    out = capsys.readouterr().out
    assert "flux2-deep" in out and "real:qwen-image" in out


def test_the_docs_table_is_up_to_date():
    from tools import plan_table

    text = plan_table.DOC.read_text(encoding="utf-8")
    assert plan_table.MARKED.search(text), "the marked plan table of docs/index.md was not found"
    assert plan_table.regenerate(text) == text, "docs/index.md's plan table is stale: run `python tools/plan_table.py`"


def test_the_docs_phase_plans_are_up_to_date():
    from tools import phase_plans

    for page in phase_plans.PAGES:
        generated = phase_plans.generated_for(page)
        text = page.read_text(encoding="utf-8")
        assert phase_plans.MARKED.search(text), f"the marked phase plans of {page.name} were not found"
        assert phase_plans.regenerate(text, generated) == text, \
            f"{page.name}'s phase plans are stale: run `python tools/phase_plans.py`"


def test_the_command_prints_the_plan_the_handle_runs(capsys):
    """``offload-core plan`` and ``enable_offload(pipe, device_memory=...)`` make the same plan of a
    pipeline: strategy, and per component its mode, kept blocks and bytes per forward."""
    import offload_core
    from offload_core.tiny import build_pipeline

    from helpers import chaos_backend

    printed = plan_json(capsys, "--pipeline", "flux2-deep", "--device-memory", "3MiB", "--bandwidth", "1e9")
    tiny = build_pipeline("flux2-deep")
    handle = offload_core.enable_offload(tiny.pipe, device_memory=3 * 2**20, backend=chaos_backend())
    try:
        ran = handle.plan.to_dict()
    finally:
        handle.disable()

    def essentials(plan: dict) -> tuple:
        return plan["strategy"], [(c["name"], c["mode"], list(c["resident_blocks"]), c["bytes_per_forward"])
                                  for c in plan["components"]]

    assert essentials(printed) == essentials(ran)
    assert ran["strategy"] == "layerwise" and any(c["resident_blocks"] for c in ran["components"])


def test_a_measured_bandwidth_is_what_the_backend_copies_at(capsys):
    from offload_core import get_backend
    from offload_core.cli.plan import measure_bandwidth

    # the fake's bandwidth model: each copy takes its bytes over this, 84 ms for 4 MiB, so that a
    # loaded machine's scheduling delays (tens of ms) cannot halve it, while the memcpy alone
    # (about 1 ms) would be 50 times faster
    modelled = 5e7
    measured, source = measure_bandwidth(get_backend("fake", h2d_bandwidth=modelled), nbytes=4 * 2**20)
    assert 0.5 * modelled < measured <= 1.05 * modelled and "fake" in source
    data = plan_json(capsys, "--device-memory", "2MiB", "--bandwidth", "measure")
    assert data["bandwidth_source"].startswith("measured: pinned copies on the") and data["bandwidth"] > 0
    streamed = next(c for c in data["components"] if c["mode"] == "streamed")
    assert streamed["copy_s_per_forward"] == pytest.approx(streamed["bytes_per_forward"] / data["bandwidth"])


def test_the_smallest_budget_named_by_a_refusal_is_accepted_as_printed(capsys):
    import re

    assert main(["plan", "--device-memory", "1KiB"]) == 2
    printed = re.search(r"the smallest budget that works is ([\d.]+ \w+)", capsys.readouterr().err).group(1)
    data = plan_json(capsys, "--device-memory", printed)
    assert data["budget"] >= data["min_budget"] and data["device_peak"] <= data["budget"]


def test_a_measured_drive_is_what_the_plan_reads_disk_blocks_at(capsys, tmp_path, monkeypatch):
    from offload_core.bench import disk

    reads = []

    def direct_read(files):
        reads.append((files, os.path.getsize(files[0])))
        return original(files)

    original = disk.direct_read
    monkeypatch.setattr(disk, "direct_read", direct_read)
    rate = disk.drive_read_bandwidth(str(tmp_path), nbytes=32 * 2**20)
    assert rate > 0 and reads[0][1] == 32 * 2**20, "the whole file read back"
    assert not os.listdir(tmp_path), "the file removed once read"
    monkeypatch.setattr(disk, "drive_read_bandwidth", lambda: 1.25e9)
    data = plan_json(capsys, "--pipeline", "real:wan2.2-t2v-a14b", "--device-memory", "24GB", "--host-memory",
                     "32GB", "--disk-bandwidth", "measure")
    assert data["disk_bandwidth"] == 1.25e9 and data["disk_bandwidth_source"].startswith("measured")
    bytes_read = sum(p["disk_bytes_per_forward"] + p["switch_disk_bytes"] for p in data["phases"])
    assert bytes_read > 0, "a plan that reads from disk at the measured rate"


def test_a_storage_dtype_plans_the_dits_as_stored(capsys):
    """``--storage-dtype`` casts the DiTs as ``storage_dtype=`` does before planning: FLUX.2-dev's
    DiT plans at most 0.52 of its bfloat16 bytes, and with 32 GB of RAM no longer reads blocks
    from disk every step."""
    argv = ("--pipeline", "real:flux2-dev", "--device-memory", "24GB", "--host-memory", "32GB")
    wide, narrow = plan_json(capsys, *argv), plan_json(capsys, *argv, "--storage-dtype", "float8_e4m3fn")

    def dit(data):
        return next(c for c in data["components"] if c["kind"] == "dit")

    def denoise(data):
        return next(p for p in data["phases"] if p["name"] == "denoise")

    assert dit(narrow)["weight_bytes"] <= 0.52 * dit(wide)["weight_bytes"]
    assert denoise(wide)["disk_bytes_per_forward"] > 0 and denoise(narrow)["disk_bytes_per_forward"] == 0
    assert main(["plan", *argv, "--storage-dtype", "bfloat16"]) == 2
    assert "narrower than the weights" in capsys.readouterr().err
