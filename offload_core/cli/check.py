"""``offload-core check-backend NAME``: run the backend conformance kit and say whether NAME passes.

A vendor writing a backend plugin should not need to know pytest's plugin and ``--pyargs``
spelling to find out whether their backend is usable; this command is that spelling, plus a
verdict in one paragraph. The kit runs in a child process (``python -m pytest``) because pytest
owns the process it runs in (``sys.modules``, warnings, exit), and because a backend that crashes
the interpreter must still leave this command alive to report it. Output is streamed as it comes,
since the kit takes tens of seconds and a hang must be visible.

The exit status is pytest's own (0 conforms, 1 failures, others: pytest could not run the kit), so
CI can use the command directly; an unknown or unavailable name, and pytest missing, are refused
up front (2).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import shlex
import subprocess
import sys
import tempfile
from typing import Any

from .common import UsageError, available_backend

KIT = "offload_core.testing"
#: outcome words on pytest's final summary line ("3 failed, 40 passed, 2 skipped in 20.1s")
OUTCOME = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)\b")


def add_check_backend(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "check-backend",
        help="run the backend conformance kit against a registered backend",
        description="Run the offload-core backend conformance kit against the registered backend NAME "
        f"('python -m pytest --backend=NAME --pyargs {KIT}'), stream its output, and summarise whether "
        "the backend conforms (needs pytest: pip install \"offload-core[test]\"). Exit status: pytest's "
        "(0: conforms, 1: tests failed); 2: unknown or unavailable backend, or pytest missing.",
    )
    parser.add_argument("name", metavar="NAME", help="a registered backend (see 'offload-core backends')")
    parser.set_defaults(run=run_check_backend)


def kit_command(name: str) -> list[str]:
    return [sys.executable, "-m", "pytest", f"--backend={name}", "--pyargs", KIT, "-q", "-p", "no:cacheprovider"]


def run_check_backend(args: argparse.Namespace) -> int:
    if importlib.util.find_spec("pytest") is None:
        raise UsageError("check-backend runs the conformance kit with pytest, which is not installed: "
                         'pip install "offload-core[test]"')
    available_backend(args.name)
    command = kit_command(args.name)
    print("$ " + shlex.join(command), flush=True)
    # Unbuffered child: its lines arrive as they are written, not when a pipe buffer fills.
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    last = ""
    # A scratch working directory: the kit must not pick up the caller's conftest.py or pytest.ini.
    with tempfile.TemporaryDirectory(prefix="offload-core-check-") as cwd:
        with subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd, bufsize=1
        ) as child:
            assert child.stdout is not None
            try:
                for line in child.stdout:
                    sys.stdout.write(line)
                    if line.strip():
                        last = line.strip()
            except BaseException:  # Ctrl-C (a signal to this process alone): the kit stops with it
                child.terminate()
                child.wait()
                raise
            code = child.wait()
    print()
    print(summary(args.name, code, last))
    return code


def counts(line: str) -> dict[str, int]:
    """Outcome counts from pytest's final line; "error" and "errors" are both counted as errors."""
    found: dict[str, int] = {}
    for number, word in OUTCOME.findall(line):
        key = "errors" if word.startswith("error") else word
        found[key] = found.get(key, 0) + int(number)
    return found


def summary(name: str, code: int, last_line: str) -> str:
    """One paragraph: the verdict, the counts, and what to do next."""
    c = counts(last_line)
    passed, failed, skipped, errors = (c.get(k, 0) for k in ("passed", "failed", "skipped", "errors"))
    tally = f"{passed} passed, {failed} failed, {skipped} skipped" + (f", {errors} errors" if errors else "")
    if code == 0 and passed > 0:
        verdict = f"Backend {name!r} conforms to the offload-core backend contract: {tally}."
        if skipped:
            verdict += " Skipped tests cover capabilities the backend does not declare."
        return verdict
    if code == 1:
        return (
            f"Backend {name!r} does NOT conform: {tally}. The failing tests above name the broken "
            f"guarantee; rerun them with 'python -m pytest --backend={name} --pyargs {KIT} -x' to stop at the first."
        )
    if code == 0:
        return f"The conformance kit passed no test for backend {name!r} ({tally}): nothing was verified."
    return (
        f"The conformance kit could not run to completion for backend {name!r} (pytest exit status {code}"
        f"{': ' + tally if c else ''}); see its output above."
    )
