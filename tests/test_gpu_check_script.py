"""``ci/gpu-check.sh --dry-run``: the prepared GPU check runs every step on the fake backend and
writes its one JSON report, so the script cannot rot between GPU runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "ci" / "gpu-check.sh"


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check") / "report.json"
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    env.pop("OFFLOAD_CORE_BACKEND", None)
    proc = subprocess.run([str(SCRIPT), "--dry-run", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "all passed" in proc.stdout
    return json.loads(out.read_text())


def test_every_step_ran_and_passed(report):
    assert report["ok"] is True and report["dry_run"] is True
    assert list(report["steps"]) == ["kit", "strategies", "bench", "realsize"]
    for name, step in report["steps"].items():
        assert step["ok"] and step["exit_status"] == 0 and step["seconds"] >= 0, name
    for name in ("kit", "strategies"):
        result = report["steps"][name]["result"]
        assert result["tests"] > 0 and result["passed"] > 0, name
        assert result["failures"] == result["errors"] == 0 and result["failed"] == [], name
    assert report["steps"]["bench"]["result"]["results"]["copies_per_block"]["fp32_copies_per_block"] == 1.0


def test_the_real_size_benchmark_reports_every_figure(report):
    result = report["steps"]["realsize"]["result"]
    assert result["dry_run"] is True and result["backend"] == "fake" and result["config"]["num_layers"] >= 2
    assert result["weight_bytes"] > 0 and result["pinned_memcpy_bytes_per_s"] > 0
    variants = result["variants"]
    assert set(variants) == {"resident", "layerwise_depth1", "layerwise_depth2", "diffusers_group_offload"}
    for name, entry in variants.items():
        assert len(entry["step_s"]) == result["steps"] and entry["ratio_to_resident"] > 0, name
        assert entry["device_peak_bytes"] >= 0, name
    for depth in (1, 2):
        entry = variants[f"layerwise_depth{depth}"]
        assert entry["exact"] is True and entry["prefetch_misses"] == 0
        assert entry["h2d_bytes_per_step"] > 0 and entry["achieved_to_memcpy"] > 0
        # real pinned bytes, as the backend measured them, hold at least the packed weights
        assert entry["pinned_host_bytes"] == entry["backend_pinned_bytes"] >= entry["host_bytes"]
    assert variants["diffusers_group_offload"]["exact"] is True
    assert variants["diffusers_group_offload"]["use_stream"] is False  # diffusers' streams need a device


def test_an_unknown_option_is_refused():
    proc = subprocess.run([str(SCRIPT), "--gpu"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown option --gpu" in proc.stderr
