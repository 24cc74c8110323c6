"""Installing offload-core registers its pytest plugin for every pytest run on the machine
(entry point ``pytest11``): without ``--backend`` a run of someone else's tests must not pay for
it. The plugin then imports neither torch nor offload_core's modules, sets no environment
variable and adds no header line; with ``--backend=fake`` it does all three, as this suite needs.

Each plugin case runs pytest in a subprocess on a one-test project outside the repository, whose
test records what its process looks like when it runs; the last case imports the library in a
fresh interpreter. docs/benchmarks.md has the times."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


SANITIZE = "OFFLOAD_CORE_FAKE_SANITIZE"

PROBE = '''
import json, os, sys

PLUGIN = {"offload_core.testing", "offload_core.testing.plugin", "offload_core.testing.capabilities"}


def test_probe():
    seen = {
        "torch": "torch" in sys.modules,
        "offload_core_modules": sorted(m for m in sys.modules if m.startswith("offload_core.") and m not in PLUGIN),
        "sanitize": os.environ.get("OFFLOAD_CORE_FAKE_SANITIZE"),
    }
    with open(os.environ["PROBE_OUT"], "w") as f:
        json.dump(seen, f)
'''


def _run(tmp_path: Path, *args: str) -> tuple[dict, str]:
    project = tmp_path / "project"
    project.mkdir()
    (project / "test_probe.py").write_text(PROBE)
    out = tmp_path / "seen.json"
    env = {k: v for k, v in os.environ.items() if k != SANITIZE}
    env["PROBE_OUT"] = str(out)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, "test_probe.py"],
        cwd=project, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc.stdout


def test_without_backend_the_plugin_imports_nothing_and_changes_nothing(tmp_path):
    seen, stdout = _run(tmp_path, "-v")
    assert seen == {"torch": False, "offload_core_modules": [], "sanitize": None}
    assert "offload_core backend" not in stdout


def test_with_backend_fake_the_plugin_sets_the_run_up(tmp_path):
    seen, stdout = _run(tmp_path, "--backend=fake", "-v")  # -q -v: the header is shown
    assert seen["torch"] and "offload_core.device.plugins" in seen["offload_core_modules"]
    assert seen["sanitize"] == "1"
    assert "offload_core backend: fake (chaos mode, race sanitizer)" in stdout


def test_importing_the_library_does_not_import_the_compiler():
    """``import offload_core`` imports none of its modules; the whole library (``enable_offload``)
    imports torch but not ``torch._dynamo`` (seconds), which model-level offload needs only once a
    strategy is built."""
    code = (
        "import sys, json, offload_core\n"
        "bare = sorted(m for m in sys.modules if m.startswith('offload_core.') or m == 'torch')\n"
        "from offload_core import enable_offload\n"
        "print(json.dumps([bare, 'torch' in sys.modules, 'torch._dynamo' in sys.modules]))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [[], True, False]
