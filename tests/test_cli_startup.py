"""``offload-core --help``, ``--version`` and usage errors answer without importing torch or
diffusers (which take seconds), checked in a fresh interpreter: the modules it loaded and the time."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

HEAVY = ("torch", "diffusers", "transformers")
#: runs the command line in-process, then prints the heavy modules it imported, as JSON
PROBE = """
import json, sys
from offload_core.cli import main
code = main(sys.argv[1:])
print(json.dumps({"code": code, "loaded": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)
LIMIT_S = 1.5


@pytest.mark.quick
@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["--version"], 0),
        (["run", "--help"], 0),
        (["bench", "--help"], 0),
        (["check-backend", "--help"], 0),
        (["plan", "--help"], 0),
        (["plan", "--device-memory", "1GiB", "--prefetch-depth", "x"], 2),
        (["run", "--no-such-flag"], 2),
        (["run", "--steps", "0"], 2),
        (["bench", "--only", "nope"], 2),
        (["no-such-command"], 2),
        ([], 2),
    ],
)
def test_help_version_and_usage_errors_import_neither_torch_nor_diffusers(argv, code):
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report == {"code": code, "loaded": []}, done.stderr
    assert elapsed < LIMIT_S, f"{argv} took {elapsed:.2f} s"


@pytest.mark.quick
def test_python_dash_m_version_is_fast_too():
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "offload_core", "--version"], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("offload-core ")
    assert time.perf_counter() - start < LIMIT_S


def test_the_package_still_exports_its_names_when_used():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, offload_core; assert 'torch' not in sys.modules; "
         "print(offload_core.enable_offload.__module__, offload_core.OffloadConfig.__module__, "
         "sorted(set(offload_core.__all__) - set(dir(offload_core))))"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.stdout.split() == ["offload_core.api", "offload_core.config", "[]"], done.stderr
