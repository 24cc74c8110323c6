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

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
CHECK, WHEELS, CHECKS = REPO / "ci" / "gpu-check.sh", REPO / "ci" / "gpu-wheels.sh", REPO / "ci" / "gpu_check.py"


def _module(name: str):
    """A module of ci/ (not a package: gpu_check.py puts ci/ on the path for its own modules)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "ci" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_check_module():
    return _module("gpu_check")


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


def test_the_dry_run_runs_every_hardware_check_on_the_simulator(tmp_path):
    """``hardware --dry-run``: no check skipped, every figure marked simulated, a crossover sweep
    over 4 token counts, host cost per block with diffusers' stream path with and without
    ``record_stream``, a profiler trace kept per measured step, and the estimate of a GPU run."""
    proc = _python("hardware", "--dry-run", "--out", str(tmp_path / "hw.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "hw.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["exact", "crossover", "host cost per block", "overlap", "host syncs", "H2D bandwidth",
                            "pinned accounting", "mem_get_info", "model-level near capacity", "stream switches",
                            "registered pinned H2D"]
    assert all(c["ok"] is True and c["simulated"] is True for c in checks.values()), proc.stdout
    assert "skipped" not in proc.stdout and "not run" not in proc.stdout
    points = {k: v for k, v in checks["crossover"]["figures"]["points"].items() if "variants" in v}
    for model in ("flux2-single", "wan-14b"):
        assert len([v for v in points.values() if v["model"] == model]) >= 4
    for point in points.values():
        assert set(point["variants"]) == {"resident", "layerwise depth 1", "layerwise depth 2", "planner"}
        for name, v in point["variants"].items():
            assert v["exact"] and v["simulated"] and v["efficiency"] == pytest.approx(v["bound_s"] / v["step_s"])
            assert v["compute_idle_us"] >= 0 and (tmp_path / v["trace"]).exists()
            if name == "resident":
                assert v["h2d_bytes_per_step"] == 0 and v["step_ratio"] == 1.0
            elif name.startswith("layerwise"):  # every block streams in every step
                assert v["h2d_bytes_per_step"] >= point["weight_bytes"]
    host = checks["host cost per block"]["figures"]
    for mode in ("eager", "regional compile"):
        for variant in ("resident", "offload-core", "diffusers record_stream=False", "diffusers record_stream=True"):
            v = host[f"{mode}, {variant}"]
            assert v["exact"] and v["host_cpu_us_per_block"] > 0 and (tmp_path / v["trace"]).exists()
        ours = host[f"{mode}, offload-core"]["runtime_calls_per_block"]
        theirs = host[f"{mode}, diffusers record_stream=False"]["runtime_calls_per_block"]
        assert ours["cudaMemcpyAsync"] >= 1 and ours["cudaStreamWaitEvent"] >= 1 and ours["cudaStreamSynchronize"] < 1
        # diffusers without record_stream waits for the compute stream at every group: a host sync per block
        assert theirs["cudaStreamSynchronize"] >= 1
    syncs = {k: v for k, v in checks["host syncs"]["figures"].items() if k != "seconds"}
    assert len(syncs) == 4 and all(v == {"cudaStreamSynchronize": 1, "cudaEventSynchronize": 0,
                                         "cudaDeviceSynchronize": 0} for v in syncs.values())
    assert 0 < report["estimate_h200_s"]["total"] <= 300


def test_the_host_sync_check_fails_a_backend_that_waits_on_the_host_per_block(tmp_path):
    """Against a fake whose event waits block the host (an event synchronize per block)."""
    from offload_core_fake import FakeBackend

    gpu_check, gpu_probe = _gpu_check_module(), _module("gpu_probe")

    class HostWaits(FakeBackend):
        def new_event(self, timing=False):
            event = super().new_event(timing)
            event.wait = lambda stream=None: event.synchronize()
            return event

    run = gpu_check.Run(True, tmp_path)
    run.calls = gpu_probe.Calls()
    run.backend = run.calls.instrument(HostWaits(chaos=False))
    check = gpu_check.Check("host syncs", "")
    gpu_check.check_syncs(run, check)
    assert check.ok is False and "other than the design's: depth 1" in check.summary
    assert check.figures["depth 1"]["cudaEventSynchronize"] >= 1


def test_the_pinned_accounting_check_fails_pinned_memory_left_after_disable(tmp_path):
    """Against a fake that keeps counting part of a registered block after it was unregistered."""
    from offload_core_fake import FakeBackend

    gpu_check, gpu_probe = _gpu_check_module(), _module("gpu_probe")

    class Leaks(FakeBackend):
        leaked = 0

        def unregister_host(self, ptr):
            super().unregister_host(ptr)
            self.leaked += 4096

        def pinned_memory_allocated(self):
            return super().pinned_memory_allocated() + self.leaked

    run = gpu_check.Run(True, tmp_path)
    run.calls = gpu_probe.Calls()
    run.backend = run.calls.instrument(Leaks(chaos=False, pinned_rounding="register"))
    check = gpu_check.Check("pinned accounting", "")
    gpu_check.check_host_memory(run, check)
    assert check.ok is False and check.figures["cycles"][0]["after_disable"] > 0
    assert check.figures["registers_homes"] is True and "VmPin" in check.summary


def test_the_stream_switch_check_fails_a_backend_that_switches_per_copy(tmp_path):
    """Against a fake whose batches do not hold the stream (every copy selects it again)."""
    from offload_core_fake import FakeBackend

    gpu_check = _gpu_check_module()

    class PerCopy(FakeBackend):
        def batch(self, stream):
            return contextlib.nullcontext(stream)  # holds nothing: every copy selects its stream

    check = gpu_check.Check("stream switches", "<= 1")
    run = gpu_check.Run(True, tmp_path)
    run.backend = PerCopy(chaos=False)
    try:
        gpu_check.check_stream_switches(run, check)
    finally:
        run.backend.close()
    assert check.ok is False and "more than one: layerwise depth 1, layerwise depth 2, model-level" in check.summary


def test_a_trace_is_read_as_the_compute_streams_kernels_the_copies_and_the_runtime_calls(tmp_path):
    """A Kineto-shaped trace by hand: the compute stream is the one with the most kernel time;
    its idle time is the window less its kernels; copies under kernels; runtime calls by name."""
    gpu_probe = _module("gpu_probe")
    events = [
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 40, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 60, "dur": 40, "args": {"stream": 7}},
        {"ph": "X", "cat": "kernel", "name": "small", "ts": 0, "dur": 5, "args": {"stream": 9}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 30, "dur": 20, "args": {}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH (Device -> Pinned)", "ts": 100, "dur": 20, "args": {}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1, "dur": 1},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 2, "dur": 1},
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 3},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    trace = gpu_probe.read_trace(path)
    assert trace.window == (0.0, 120.0) and trace.compute_busy_us == 80.0 and trace.compute_idle_us == 40.0
    assert trace.copies_under_kernels == 0.5  # the HtoD copy 30..50 lies under the kernel 0..40 for 10
    assert trace.calls == {"cudaStreamSynchronize": 1, "cudaMemcpyAsync": 1} and trace.simulated is False
    assert gpu_probe.covered([(0.0, 10.0), (20.0, 30.0)], [(5.0, 12.0), (8.0, 9.0), (25.0, 40.0)]) == 0.5
    assert gpu_probe.covered([(0.0, 10.0)], []) == 0.0


def test_the_simulator_profile_writes_the_device_side_a_gpu_trace_has(tmp_path):
    """On the fake: the compute thread's operators as kernels, the fake's copies as HtoD copies,
    the backend's calls as runtime calls, in the exported file, marked simulated."""
    import offload_core

    gpu_probe = _module("gpu_probe")
    backend, probe, _ = gpu_probe.make_probe(dry_run=True)
    model, inputs = _gpu_check_module()._stack((64, 256, 4, 8))
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    try:
        with torch.no_grad():
            model(inputs[0])
            trace = probe.profile(lambda: model(inputs[1]), tmp_path / "trace.json")
    finally:
        handle.disable()
    assert trace.simulated and json.loads((tmp_path / "trace.json").read_text())["simulated"] is True
    assert len(trace.kernels) >= 8 and len(trace.copies) == 4  # one copy per block of one dtype
    assert trace.calls["cudaMemcpyAsync"] == 4 and trace.calls["cudaStreamSynchronize"] == 1
    assert 0 <= trace.compute_idle_us <= trace.window_us


def test_the_link_facts_say_what_a_machine_without_a_gpu_cannot_tell():
    import offload_core

    facts = _module("gpu_host").link_facts(True, offload_core.get_backend("fake", chaos=False))
    assert facts["pcie_generation"] is None and "dry run" in facts["unavailable"]["pcie"]
    assert facts["gpu_numa_node"] is None and facts["unavailable"]["gpu_numa_node"]
    assert facts["home_numa_node"] is not None or facts["unavailable"]["home_numa_node"]


def test_the_estimate_of_a_gpu_run_is_its_steps_and_fits_in_five_minutes():
    estimate = _gpu_check_module().estimate()
    steps = ("install", "environment", "kit", "strategies", "hardware", "realsize")
    assert set(estimate) == {*steps, "total"} and estimate["total"] == pytest.approx(sum(estimate[s] for s in steps))
    assert estimate["total"] <= 300


def test_the_table_shows_each_step_and_check_with_its_state():
    gpu_check = _gpu_check_module()
    checks = [{"name": "exact", "ok": False, "target": "bit-equal", "summary": "differs from resident: x", "figures": {}},
              {"name": "overlap", "ok": True, "target": ">= 80%", "summary": "91% of H2D copy time", "figures": {}}]
    link = {"pcie_generation": 5, "pcie_width": 16, "gpu_numa_node": 1, "home_numa_node": 1}
    report = {"ok": False, "dry_run": False, "seconds": 12.0, "steps": {
        "install": {"ok": True, "exit_status": 0, "seconds": 3.0, "result": None},
        "environment": {"ok": True, "exit_status": 0, "seconds": 1.0, "result": {
            "torch": "2.9", "cuda_runtime": "12.8", "device": "NVIDIA H200", "host_cache_api": "x",
            "compiler_disable": "(fn=None)", "link": link}},
        "kit": {"ok": True, "exit_status": 0, "seconds": 4.0,
                "result": {"passed": 5, "failures": 0, "errors": 0, "skipped": 1}},
        "hardware": {"ok": False, "exit_status": 1, "seconds": 5.0,
                     "result": {"checks": checks, "estimate_h200_s": {"total": 281.6}}},
    }}
    text = gpu_check.table(report)
    assert text.startswith("# gpu-check: FAILED (GPU run, 12 s; estimated on an H200 from its work: 282 s)")
    assert "| offline install (carried wheels) | pass | exit status 0 (3 s) |" in text
    assert "PCIe gen 5 x16, GPU NUMA node 1, homes on node 1" in text
    assert "| conformance kit | pass | 5 passed, 0 failed, 1 skipped (4 s) |" in text
    assert "| &nbsp; exact | FAIL | differs from resident: x (target: bit-equal) |" in text
    assert "| &nbsp; overlap | pass | 91% of H2D copy time (target: >= 80%) |" in text


def test_the_report_holds_each_step_and_names_the_traces_kept_beside_it(tmp_path):
    check_report = _module("check_report")
    (tmp_path / "hardware.json").write_text(json.dumps({"checks": [], "estimate_h200_s": {"total": 1.0}}))
    (tmp_path / "trace-overlap.json").write_text("{}")
    (tmp_path / "trace-host-eager-resident.json").write_text("{}")
    steps = tmp_path / "steps.tsv"
    steps.write_text(f"install\t0\t3\t-\nhardware\t1\t5\t{tmp_path / 'hardware.json'}\n")
    document = check_report.report(steps, True, tmp_path / "report.json")
    assert document["ok"] is False and document["seconds"] == 8.0 and document["dry_run"] is True
    assert document["steps"]["hardware"]["result"]["estimate_h200_s"] == {"total": 1.0}
    assert document["traces"] == ["trace-host-eager-resident.json", "trace-overlap.json"]
