"""docs/cli.md's sample outputs, made by running the commands they show: ``python -m
offload_core.cli_run.sample`` rewrites each block that follows a ``<!-- output of: COMMAND -->``
line with what COMMAND prints now (in-process, on the fake backend).

A test reruns them and compares, with the figures that depend on timing (times, overlap, the
ratio, and the copy counts a late prefetch can change) masked, so the page cannot go stale.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
MARKED = re.compile(r"(<!-- output of: (.+?) -->\n```\n)(.*?)(```)", re.S)
#: report rows whose figures depend on timing
TIMED_ROWS = ("time per step", "call", "moved host -> device", "overlap (copy hidden)", "without offload", "verdict")
NUMBER = re.compile(r"\d+(\.\d+)?")


def output_of(command: str) -> str:
    """What ``offload-core ...`` prints on stdout (progress bars go to stderr)."""
    from ..cli import main

    argv = shlex.split(command)
    assert argv[0] == "offload-core", command
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([*argv[1:], "--backend", "fake"] if argv[1] == "run" and "list" not in argv else argv[1:])
    if code != 0:
        raise RuntimeError(f"{command} exited {code}")
    return out.getvalue()


def regenerate(text: str) -> str:
    return MARKED.sub(lambda m: m.group(1) + output_of(m.group(2)) + m.group(4), text)


def masked(text: str) -> str:
    """``text`` with the numbers of timed report rows replaced by ``#``."""
    lines = []
    for line in text.splitlines():
        label = re.split(r"\s{2,}", line, maxsplit=1)[0]
        lines.append(NUMBER.sub("#", line) if label in TIMED_ROWS else line)
    return "\n".join(lines)


if __name__ == "__main__":
    DOC.write_text(regenerate(DOC.read_text(encoding="utf-8")), encoding="utf-8")
    print(f"rewrote the sample outputs of {DOC}", file=sys.stderr)
