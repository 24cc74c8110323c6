"""The README's commands are the ones CI runs: keep them true."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    return re.findall(r"```bash\n(.+?)\n```", text)


def test_ci_runs_the_readme_test_command_verbatim():
    install_and_run, tests = readme_commands()[:2]
    assert tests.endswith("pytest --backend=fake")
    assert tests in (ROOT / "ci" / "test.sh").read_text(encoding="utf-8")
    assert "ci/test.sh" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")


def test_readme_main_job_runs_the_embedded_demo():
    install_and_run = readme_commands()[0]
    assert install_and_run.endswith("offload-core run")
    assert "torch==2.13.0" in install_and_run
