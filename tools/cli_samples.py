"""The sample outputs in docs/cli.md and README.md, made by running the commands they show:
``python tools/cli_samples.py`` rewrites each block that follows a ``<!-- output of:
COMMAND -->`` line with what COMMAND prints now (in-process, on the fake backend); ``COMMAND |
grep WORD`` keeps the lines holding WORD, as the shell would.

A test reruns them and compares, with the figures that depend on timing (times, overlap, the
ratio, the copy counts a late prefetch can change, each number with its unit) masked, and the
verdict's "unreliable (machine busy)" clause and the step row's garbage collections dropped, so
the pages cannot go stale and a busy machine or a collection cannot fail the comparison. The generator refuses to run on a busy machine, or to write a
run that says its figures are unreliable, so the pages never take a busy machine's figures.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from pathlib import Path

from offload_core.cli.run.steady import UNRELIABLE, busy_machine

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
#: the pages whose marked blocks are generated
PAGES = (DOC, ROOT / "README.md")
MARKED = re.compile(r"(<!-- output of: (.+?) -->\n```\n)(.*?)(```)", re.S)
#: report rows whose figures depend on timing
TIMED_ROWS = ("time per step", "call", "moved host -> device", "overlap (copy hidden)", "without offload", "verdict")
#: a number and the unit after it, if any: "118.4 ms" and "1.20 s" are the same figure on two machines
NUMBER = re.compile(r"\d+(\.\d+)?(\s?(ns|us|ms|s|%|x)(?![\w]))?")
#: the verdict's last clause on a run that cannot vouch for its figures
UNRELIABLE_CLAUSE = re.compile(r"; " + re.escape(UNRELIABLE) + r".*$")
#: the step row's clause naming the garbage collections left out of its times
COLLECTION_CLAUSE = re.compile(r"; Python's garbage collector held .*? \(left out of these times\)")


def output_of(command: str) -> str:
    """What ``offload-core ...`` prints on stdout (progress bars go to stderr), filtered by a
    trailing ``| grep WORD``."""
    from offload_core.cli import main

    command, _, grep = command.partition(" | grep ")
    argv = shlex.split(command)
    assert argv[0] == "offload-core", command
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = main([*argv[1:], "--backend", "fake"] if argv[1] == "run" and "list" not in argv else argv[1:])
    if code != 0:
        raise RuntimeError(f"{command} exited {code}")
    text = out.getvalue()
    if grep:
        text = "".join(line for line in text.splitlines(keepends=True) if grep.strip() in line)
    return text


def regenerate(text: str) -> str:
    return MARKED.sub(lambda m: m.group(1) + output_of(m.group(2)) + m.group(4), text)


def masked(text: str) -> str:
    """``text`` with the numbers of timed report rows (with their units) replaced by ``#``, and
    the verdict's "unreliable (machine busy)" clause and the garbage collections dropped."""
    lines = []
    for line in text.splitlines():
        label = re.split(r"\s{2,}", line, maxsplit=1)[0]
        timed = label in TIMED_ROWS
        lines.append(NUMBER.sub("#", COLLECTION_CLAUSE.sub("", UNRELIABLE_CLAUSE.sub("", line))) if timed else line)
    return "\n".join(lines)


def stale(page: Path) -> list[str]:
    """The lines of ``page``'s marked blocks that differ from what the commands print now beyond
    timing (masked), as ``page: expected / printed`` pairs; empty when it is up to date."""
    text = page.read_text(encoding="utf-8")
    old, new = masked(text).splitlines(), masked(regenerate(text)).splitlines()
    if len(old) != len(new):
        return [f"{page.name}: the marked blocks now print {len(new) - len(old):+d} lines"]
    return [f"{page.name}: {a!r}\n  now {b!r}" for a, b in zip(old, new) if a != b]


def main() -> int:
    busy = busy_machine()
    if busy:
        print(f"not rewriting the sample outputs on a busy machine ({busy}): their times would be this load's",
              file=sys.stderr)
        return 1
    for page in PAGES:
        text = regenerate(page.read_text(encoding="utf-8"))
        if any(UNRELIABLE in block for _, _, block, _ in MARKED.findall(text)):
            print(f"not rewriting {page}: the run says its figures are {UNRELIABLE}", file=sys.stderr)
            return 1
        page.write_text(text, encoding="utf-8")
        print(f"rewrote the sample outputs of {page}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
