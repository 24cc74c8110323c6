"""``offload-core check-backend NAME``: runs the conformance kit in a child pytest and gives a verdict."""

from __future__ import annotations

import subprocess

import pytest

from offload_core import cli
from offload_core.cli.check import counts, summary


@pytest.mark.quick
def test_the_fake_backend_conforms(capsys):
    code = cli.main(["check-backend", "fake"])
    out, _ = capsys.readouterr()
    lines = [line for line in out.splitlines() if line.strip()]
    assert code == 0
    assert lines[0].startswith("$ ") and "-m pytest --backend=fake --pyargs offload_core.testing" in lines[0]
    # the kit's own output was streamed through, ending with pytest's summary line ...
    tally = counts(lines[-2])
    assert tally.get("passed", 0) > 0 and tally.get("failed", 0) == 0
    # ... and the verdict repeats its counts
    verdict = lines[-1]
    assert verdict.startswith("Backend 'fake' conforms")
    assert f"{tally['passed']} passed, 0 failed, {tally.get('skipped', 0)} skipped" in verdict


def test_without_pytest_it_is_one_line_naming_the_test_extra(capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "pytest" else find_spec(name, *a))
    monkeypatch.setattr(subprocess, "Popen", _no_child)
    assert cli.main(["check-backend", "fake"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert err.startswith("offload-core: error: check-backend runs the conformance kit with pytest") and \
        'pip install "offload-core[test]"' in err


def _no_child(*args, **kwargs):
    raise AssertionError("the kit was started without pytest")


def test_unknown_backend_is_refused_before_anything_runs(capsys, monkeypatch):
    def no_child(*args, **kwargs):
        raise AssertionError("the kit was started for an unknown backend")

    monkeypatch.setattr(subprocess, "Popen", no_child)
    code = cli.main(["check-backend", "nope"])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    [line] = err.splitlines()
    assert line.startswith("offload-core: error: unknown offload backend 'nope'") and "fake" in line


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("41 passed, 3 skipped in 21.07s", {"passed": 41, "skipped": 3}),
        ("2 failed, 39 passed, 1 error, 1 warning in 9.5s", {"failed": 2, "passed": 39, "errors": 1}),
        ("no tests ran in 0.01s", {}),
    ],
)
def test_counts_from_pytest_summary_lines(line, expected):
    assert counts(line) == expected


def test_summary_says_what_went_wrong():
    failing = summary("acme", 1, "2 failed, 39 passed in 9.5s")
    assert "'acme' does NOT conform: 39 passed, 2 failed, 0 skipped" in failing
    assert "--backend=acme" in failing  # how to rerun
    broken = summary("acme", 4, "ERROR: usage")
    assert "could not run to completion" in broken and "exit status 4" in broken
    assert "conforms" not in summary("acme", 0, "no tests ran in 0.01s")  # nothing passed: no verdict of conformance
