"""The offline GPU check (ci/gpu-check.sh, ci/gpu-wheels.sh, ci/gpu_check.py), the parts that run
here. The whole dry run (the offline install of the carried wheels over a bare torch, then every
step on the fake backend) is CI's last step, over the oldest torch we declare: ci/test.sh."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CHECK, WHEELS, CHECKS = REPO / "ci" / "gpu-check.sh", REPO / "ci" / "gpu-wheels.sh", REPO / "ci" / "gpu_check.py"


def _gpu_check_module():
    spec = importlib.util.spec_from_file_location("gpu_check", CHECKS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _python(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "OFFLOAD_CORE_BACKEND"}
    return subprocess.run([sys.executable, str(CHECKS), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_ci_runs_the_dry_run_over_the_oldest_declared_torch():
    script = (REPO / "ci" / "test.sh").read_text(encoding="utf-8")
    assert "ci/gpu-check.sh --dry-run --python .venv-oldest/bin/python" in script
    assert 'pip install -q "torch==$OLDEST"' in script and "ci/gpu-wheels.sh --python-version" in script


def test_unknown_options_are_refused():
    for script in (CHECK, WHEELS):
        proc = subprocess.run([str(script), "--gpu"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2 and "unknown option --gpu" in proc.stderr, script


def test_without_carried_wheels_it_says_how_to_make_them(tmp_path):
    proc = subprocess.run([str(CHECK), "--dry-run", "--wheels", str(tmp_path / "none"), "--out", str(tmp_path / "out")],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert f"no wheels in {tmp_path / 'none'}: run ci/gpu-wheels.sh first" in proc.stdout
    assert (tmp_path / "out" / "log.txt").exists()


def test_the_environment_step_fails_unless_offload_core_comes_from_the_installed_wheel(tmp_path):
    proc = _python("environment", "--dry-run", "--site", str(tmp_path), "--out", str(tmp_path / "env.json"))
    facts = json.loads((tmp_path / "env.json").read_text())
    assert proc.returncode == 1 and "gpu-check: FAIL: environment" in proc.stdout
    assert facts["from_wheel"] is False and facts["torch"]
    assert facts["compiler_disable"].startswith("(fn=None, recursive=True")


def test_the_dry_run_hardware_step_runs_the_generic_checks_on_the_fake_backend_and_skips_the_rest(tmp_path):
    proc = _python("hardware", "--dry-run", "--out", str(tmp_path / "hw.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    checks = {c["name"]: c for c in json.loads((tmp_path / "hw.json").read_text())["checks"]}
    assert list(checks) == ["exact", "overlap", "host syncs", "H2D bandwidth", "pinned accounting",
                            "mem_get_info", "model-level near capacity", "stream switches", "registered pinned H2D"]
    exact = checks.pop("exact")
    assert exact["ok"] is True and "bit-equal to resident" in exact["summary"]
    assert set(exact["figures"]) == {f"{c} depth {d}" for c in ("copy-bound", "compute-bound") for d in (1, 2)}
    # stream switches per block, counted by the fake as an accelerator enters them: at most one
    switches = checks.pop("stream switches")
    assert switches["ok"] is True, switches["summary"]
    figures = switches["figures"]
    assert set(figures) == {"layerwise depth 1", "layerwise depth 2", "model-level"}
    assert all(0 < f["switches_per_block"] <= 1 for f in figures.values()), figures
    assert figures["model-level"]["switches_per_forward"] == figures["model-level"]["loads_per_forward"] == 1
    assert "gpu-check: pass: stream switches: stream switches per block" in proc.stdout
    # the fake has no registered pinned memory: the figure is reported as not available, not passed
    registered = checks.pop("registered pinned H2D")
    assert registered["ok"] is None and registered["summary"].startswith("not available: backend 'fake' lists no")
    assert "gpu-check: skipped: registered pinned H2D: not available" in proc.stdout
    for check in checks.values():
        assert check["ok"] is None and check["summary"] == "skipped: no GPU", check["name"]
        assert f"gpu-check: skipped: {check['name']}: skipped: no GPU" in proc.stdout


def test_the_stream_switch_check_fails_a_backend_that_switches_per_copy():
    """Against a fake whose batches do not hold the stream (every copy selects it again)."""
    from offload_core_fake import FakeBackend

    gpu_check = _gpu_check_module()

    class PerCopy(FakeBackend):
        def batch(self, stream):
            return contextlib.nullcontext(stream)  # holds nothing: every copy selects its stream

    check = gpu_check.Check("stream switches", "<= 1")
    backend = PerCopy(chaos=False)
    try:
        gpu_check.check_stream_switches(backend, gpu_check.TINY_CONFIGS, check)
    finally:
        backend.close()
    assert check.ok is False and "more than one: layerwise depth 1, layerwise depth 2, model-level" in check.summary


def test_the_table_shows_each_step_and_check_with_its_state():
    gpu_check = _gpu_check_module()
    checks = [{"name": "exact", "ok": False, "target": "bit-equal", "summary": "differs from resident: x", "figures": {}},
              {"name": "overlap", "ok": None, "target": ">= 80%", "summary": "skipped: no GPU", "figures": {}}]
    report = {"ok": False, "dry_run": False, "seconds": 12.0, "steps": {
        "install": {"ok": True, "exit_status": 0, "seconds": 3.0, "result": None},
        "kit": {"ok": True, "exit_status": 0, "seconds": 4.0,
                "result": {"passed": 5, "failures": 0, "errors": 0, "skipped": 1}},
        "hardware": {"ok": False, "exit_status": 1, "seconds": 5.0, "result": {"checks": checks}},
    }}
    text = gpu_check.table(report)
    assert text.startswith("# gpu-check: FAILED (GPU run, 12 s)")
    assert "| offline install (carried wheels) | pass | exit status 0 (3 s) |" in text
    assert "| conformance kit | pass | 5 passed, 0 failed, 1 skipped (4 s) |" in text
    assert "| &nbsp; exact | FAIL | differs from resident: x (target: bit-equal) |" in text
    assert "| &nbsp; overlap | skipped | skipped: no GPU (target: >= 80%) |" in text


def test_the_overlap_share_counts_only_copy_time_under_kernels():
    gpu_check = _gpu_check_module()
    copies = [(0.0, 10.0), (20.0, 30.0)]
    kernels = [(5.0, 12.0), (8.0, 9.0), (25.0, 40.0)]
    assert gpu_check._covered(copies, kernels) == (5.0 + 5.0) / 20.0
    assert gpu_check._covered(copies, []) == 0.0
