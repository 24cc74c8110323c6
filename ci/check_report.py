"""The one JSON report of ``ci/gpu-check.sh``: every step's exit status and duration, with what it
produced (pytest's JUnit XML reduced to counts and failing test ids, benchmark JSON as is), and
the profiler traces the hardware checks kept beside it.

The script records one line per step in a tab-separated file (name, exit status, seconds, the
file the step wrote or ``-``) and calls this module last.
"""

from __future__ import annotations

import argparse
import json
import platform
import xml.etree.ElementTree as ElementTree
from pathlib import Path
from typing import Any

import torch


def junit_summary(path: Path) -> dict[str, Any]:
    """Counts of a pytest JUnit XML report, and the ids of the tests that failed or errored."""
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = [
        f"{case.get('classname')}::{case.get('name')}"
        for suite in suites
        for case in suite.iter("testcase")
        if case.find("failure") is not None or case.find("error") is not None
    ]
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "failed": failed}


def read_step(line: str) -> dict[str, Any]:
    name, status, seconds, artifact = line.rstrip("\n").split("\t")
    step: dict[str, Any] = {"name": name, "exit_status": int(status), "seconds": float(seconds), "ok": status == "0"}
    path = Path(artifact)
    if artifact == "-" or not path.exists():
        step["result"] = None
    elif path.suffix == ".xml":
        step["result"] = junit_summary(path)
    else:
        step["result"] = json.loads(path.read_text(encoding="utf-8"))
    return step


def report(steps_file: Path, dry_run: bool, out: Path) -> dict[str, Any]:
    steps = [read_step(line) for line in steps_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {
        "ok": all(s["ok"] for s in steps),
        "dry_run": dry_run,
        "seconds": sum(s["seconds"] for s in steps),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "steps": {s.pop("name"): s for s in steps},
        "traces": sorted(p.name for p in out.parent.glob("trace-*.json")),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python ci/check_report.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", required=True, type=Path, help="the tab-separated step log")
    parser.add_argument("--out", required=True, type=Path, help="the JSON report to write")
    parser.add_argument("--dry-run", action="store_true", help="mark the report as a dry run")
    args = parser.parse_args(argv)
    document = report(args.steps, args.dry_run, args.out)
    args.out.write_text(json.dumps(document, indent=2), encoding="utf-8")
    failed = [name for name, step in document["steps"].items() if not step["ok"]]
    print(f"{args.out}: {len(document['steps'])} steps in {document['seconds']:.0f} s; "
          + (f"FAILED: {', '.join(failed)}" if failed else "all passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
