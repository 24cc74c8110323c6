"""Throwaway plugin distributions, installed the way a vendor's would be: a one-module project
with an ``offload_core`` entry point, built and installed offline into a target folder, and the
conformance kit's results read back from its output."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

PYPROJECT = """\
[build-system]
requires = ["setuptools"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.0.1"

[project.entry-points.offload_core]
{entry} = "{module}"

[tool.setuptools]
py-modules = ["{module}"]
"""


def write_project(root: Path, dist: str, entry: str, module: str, source: str) -> Path:
    """A project folder for distribution ``dist`` whose entry point ``entry`` names ``module``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "pyproject.toml").write_text(PYPROJECT.format(dist=dist, entry=entry, module=module))
    (root / f"{module}.py").write_text(source)
    return root


def pip_install(target: Path, *projects: Path) -> None:
    """Install local projects into ``target`` offline (no index, no build isolation: the venv's
    setuptools builds them), as a vendor's distribution would be installed."""
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index"]
    cmd += ["--disable-pip-version-check", "--target", str(target), *(str(p.resolve()) for p in projects)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"


def write_installed(target: Path, dist: str, entry: str, module: str, source: str) -> Path:
    """Distribution ``dist`` as an installer leaves it in ``target`` (the module and its
    ``.dist-info`` with the entry point), without running pip: for tests that need many plugins."""
    target.mkdir(parents=True, exist_ok=True)
    (target / f"{module}.py").write_text(source)
    info = target / f"{dist.replace('-', '_')}-0.0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.0.1\n")
    (info / "entry_points.txt").write_text(f"[offload_core]\n{entry} = {module}\n")
    return target


def plugin_env(path: Path) -> dict[str, str]:
    """This environment, minus offload-core and pytest settings, with ``path`` importable."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OFFLOAD_CORE_", "PYTEST_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(path), os.environ.get("PYTHONPATH")]))
    return env


def outcomes(output: str) -> tuple[set[str], set[str]]:
    """(passed, failed) test ids, relative to the kit package, from ``pytest -rA`` output."""
    found: dict[str, set[str]] = {"PASSED": set(), "FAILED": set()}
    for status, nodeid in re.findall(r"^(PASSED|FAILED) (\S+\.py::\S+)", output, re.M):
        found[status].add(nodeid.split("offload_core/testing/")[-1])
    return found["PASSED"], found["FAILED"]
