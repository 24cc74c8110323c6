"""``offload-core backends``: the table, the JSON document, the selection line, plugin failures,
and the error contract (bad input is one line on stderr and exit status 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from offload_core import cli
from offload_core.device.plugins import ENV_BACKEND, PluginFailure, registry

KINDS = {"simulator", "in-tree accelerator", "vendor accelerator"}


pytestmark = pytest.mark.usefixtures("no_env_override")


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_lists_every_registered_backend_and_the_auto_selection(capsys):
    code, out, err = run_main(capsys, "backends")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["name", "source", "available", "priority", "kind", "note"]
    rows = {line.split()[0]: line for line in lines[1 : lines.index("")]}
    assert {"fake", "cuda", "npu"} <= set(rows)
    assert rows["fake"].split()[:5] == ["fake", "offload-core", "yes", "0", "simulator"]
    assert rows["cuda"].split()[1] == "offload-core" and "in-tree accelerator" in rows["cuda"]
    chosen, why = registry().auto()
    assert f"auto-detection selects {chosen.name!r}: {why}" in lines


def test_an_unavailable_backend_says_why(capsys):
    registered = {b["name"]: b for b in cli.backends_report()["backends"]}
    if registered["cuda"]["available"]:
        pytest.skip("CUDA is available here")
    _, out, _ = run_main(capsys, "backends")
    cuda_row = next(line for line in out.splitlines() if line.startswith("cuda "))
    assert cuda_row.rstrip().endswith(registered["cuda"]["reason"])
    assert registered["cuda"]["reason"]  # the CUDA backend explains itself


def test_json_document(capsys):
    code, out, _ = run_main(capsys, "backends", "--json")
    assert code == 0
    doc = json.loads(out)
    assert set(doc) == {"backends", "auto", "override", "failures"}
    rows = {b["name"]: b for b in doc["backends"]}
    assert rows["fake"] == {
        "name": "fake",
        "source": "offload-core",
        "entry_point": "fake = offload_core_fake",
        "available": True,
        "priority": 0,
        "kind": "simulator",
        "reason": None,
    }
    assert all(b["kind"] in KINDS for b in doc["backends"])
    assert doc["auto"]["name"] == registry().auto()[0].name
    assert doc["override"] is None and doc["failures"] == []


def test_environment_override_is_reported(capsys, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "fake")
    code, out, _ = run_main(capsys, "backends")
    assert code == 0
    assert "OFFLOAD_CORE_BACKEND='fake' overrides auto-detection: get_backend() returns 'fake'" in out


def test_environment_override_naming_no_backend_is_bad_input(capsys, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "nosuch")
    code, out, err = run_main(capsys, "backends", "--json")
    assert code == 2
    assert json.loads(out)["override"] == {
        "variable": ENV_BACKEND,
        "value": "nosuch",
        "registered": False,
        "available": False,
    }
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("offload-core: error: OFFLOAD_CORE_BACKEND='nosuch' names no registered backend")
    assert "cuda, fake, npu" in err


@pytest.mark.parametrize(
    "argv, message",
    [
        ([], "the following arguments are required: COMMAND"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["backends", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_status_2(capsys, argv, message):
    code, out, err = run_main(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("offload-core: error: ") and message in err


def test_help_exits_cleanly(capsys):
    code, out, _ = run_main(capsys, "backends", "--help")
    assert code == 0 and "--json" in out


def test_plugin_failures_are_listed(capsys, monkeypatch):
    failure = PluginFailure("acme = acme_offload", "acme-offload", "ImportError: no module named acme_runtime")
    monkeypatch.setattr(registry(), "failures", [failure])
    _, out, _ = run_main(capsys, "backends")
    assert out.splitlines()[-2:] == [
        "plugins that failed to load (skipped):",
        "  acme = acme_offload (from acme-offload): ImportError: no module named acme_runtime",
    ]


# -- the installed console script, with a third-party distribution on the path ----------------

VENDOR_PLUGIN = '''
from offload_core import hookimpl
from offload_core_fake import FakeBackend

class AcmeBackend(FakeBackend):
    name = "acme"
    is_accelerator = True
    priority = 1

@hookimpl
def offload_core_register_backends(register):
    register(AcmeBackend)
'''


@pytest.fixture
def vendor_distribution(tmp_path: Path) -> Path:
    """A distribution "acme-offload" with a working backend and a plugin that cannot import."""
    (tmp_path / "acme_offload.py").write_text(VENDOR_PLUGIN)
    (tmp_path / "acme_broken.py").write_text("import acme_runtime_that_is_not_installed\n")
    dist_info = tmp_path / "acme_offload-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: acme-offload\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[offload_core]\nacme = acme_offload\nbroken = acme_broken\n")
    return tmp_path


def test_console_script_shows_vendor_backends_and_failures(vendor_distribution):
    script = Path(sys.executable).with_name("offload-core")
    assert script.exists(), "the offload-core console script is not installed next to this interpreter"
    env = {k: v for k, v in os.environ.items() if k != ENV_BACKEND}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(vendor_distribution), env.get("PYTHONPATH")]))
    proc = subprocess.run([str(script), "backends"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    acme = next(line for line in lines if line.startswith("acme "))
    assert acme.split()[:4] == ["acme", "acme-offload", "yes", "1"] and "vendor accelerator" in acme
    assert lines[1].startswith("acme "), "a vendor accelerator ranks first"
    why = "highest-ranked available backend: third-party (acme-offload) accelerator, priority 1"
    assert f"auto-detection selects 'acme': {why}" in lines
    assert lines[-1].startswith("  broken = acme_broken (from acme-offload): ModuleNotFoundError:")
    assert "Traceback" not in proc.stderr


def test_python_dash_m_runs_the_same_command():
    env = {k: v for k, v in os.environ.items() if k != ENV_BACKEND}
    argv = [sys.executable, "-m", "offload_core", "backends", "--json"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert {"fake", "cuda", "npu"} <= {b["name"] for b in json.loads(proc.stdout)["backends"]}
