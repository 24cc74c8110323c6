"""``offload-core --help``, ``--version`` and usage errors answer without importing torch or
diffusers (which take seconds), checked in a fresh interpreter: the modules it loaded and the CPU
time it took (not the wall time, which a loaded machine stretches whatever the command does)."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

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


def run_timed(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run ``argv``; return it and the CPU seconds (user and system) the child used."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return done, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


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
    done, cpu = run_timed([sys.executable, "-c", PROBE, *argv])
    report = json.loads(done.stderr.strip().splitlines()[-1])
    assert report == {"code": code, "loaded": []}, done.stderr
    assert cpu < LIMIT_S, f"{argv} took {cpu:.2f} s of CPU"


@pytest.mark.quick
def test_python_dash_m_version_is_fast_too():
    done, cpu = run_timed([sys.executable, "-m", "offload_core", "--version"])
    assert done.returncode == 0 and done.stdout.startswith("offload-core ")
    assert cpu < LIMIT_S, f"took {cpu:.2f} s of CPU"


def test_the_package_still_exports_its_names_when_used():
    done = subprocess.run(
        [sys.executable, "-c", "import sys, offload_core; assert 'torch' not in sys.modules; "
         "print(offload_core.enable_offload.__module__, offload_core.OffloadConfig.__module__, "
         "sorted(set(offload_core.__all__) - set(dir(offload_core))))"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.stdout.split() == ["offload_core.api", "offload_core.common.config", "[]"], done.stderr
