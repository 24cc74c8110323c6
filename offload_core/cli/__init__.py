"""The ``offload-core`` command line (also ``python -m offload_core``).

Each subcommand is one ``add_<name>(subparsers)`` function that builds its parser and sets
``run`` to the function executing it, listed in :data:`SUBCOMMANDS`. A new subcommand (``run``,
``bench``, ``check-backend NAME``) can live in its own module: write its ``add_`` function there
and append it to :data:`SUBCOMMANDS`; nothing else here changes.

Building the parser imports neither torch nor diffusers (each subcommand imports what it needs
when it runs), so ``--help``, ``--version`` and usage errors answer at once.

Error contract: bad input (an unknown option or command, a backend name nobody registered) is one
line on stderr and exit status 2, never a traceback, because these commands run in scripts and CI
logs where a traceback hides the one line that matters. A ``run`` function raises
:class:`UsageError` for that; anything else escaping it is a bug and keeps its traceback. Ctrl-C,
in any command and at any point of it, is ``offload-core: interrupted`` and exit status 130 (what a
shell reports for a process SIGINT ended), handled here once for every subcommand.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

from .bench import add_bench
from .check import add_check_backend
from .common import UsageError, columns
from .plan import add_plan
from .run import add_run

if TYPE_CHECKING:
    from ..device import plugins

PROG = "offload-core"


class _Parser(argparse.ArgumentParser):
    """argparse prints usage plus the error and exits; we want one line and a return value."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')")


# -- backends ---------------------------------------------------------------------------------


def _kind(info: plugins.BackendInfo) -> str:
    """The auto-detection tier, in words (matches ``BackendInfo.rank``)."""
    if not info.cls.is_accelerator:
        return "simulator"
    return "in-tree accelerator" if info.in_tree else "vendor accelerator"


def backends_report() -> dict[str, Any]:
    """Everything ``offload-core backends`` shows, as plain data (the ``--json`` document)."""
    from ..device import plugins

    registry = plugins.registry()
    rows = []
    for info in plugins.list_backends():
        available = info.available
        rows.append(
            {
                "name": info.name,
                "source": info.source,
                "entry_point": info.entry_point,
                "available": available,
                "priority": info.priority,
                "kind": _kind(info),
                "reason": info.unavailable_reason(),
            }
        )
    try:
        chosen, why = registry.auto()
        auto = {"name": chosen.name, "reason": why}
    except plugins.BackendNotFoundError as exc:
        auto = {"name": None, "reason": str(exc)}
    env = os.environ.get(plugins.ENV_BACKEND) or None
    override = None
    if env is not None:
        row = next((r for r in rows if r["name"] == env), None)
        override = {
            "variable": plugins.ENV_BACKEND,
            "value": env,
            "registered": row is not None,
            "available": bool(row and row["available"]),
        }
    failures = [{"entry_point": f.entry_point, "source": f.source, "error": f.error} for f in registry.failures]
    return {"backends": rows, "auto": auto, "override": override, "failures": failures}


def _table(rows: list[dict[str, Any]]) -> list[str]:
    header = ("name", "source", "available", "priority", "kind", "note")
    cells = [
        (r["name"], r["source"], "yes" if r["available"] else "no", str(r["priority"]), r["kind"], r["reason"] or "")
        for r in rows
    ]
    return columns([header, *cells])


def _render(report: dict[str, Any]) -> str:
    lines = _table(report["backends"]) if report["backends"] else ["no backend is registered"]
    lines.append("")
    auto = report["auto"]
    if auto["name"] is None:
        lines.append(f"auto-detection selects nothing: {auto['reason']}")
    else:
        lines.append(f"auto-detection selects {auto['name']!r}: {auto['reason']}")
    override = report["override"]
    if override is not None:
        var, value = override["variable"], override["value"]
        if override["available"]:
            lines.append(f"{var}={value!r} overrides auto-detection: get_backend() returns {value!r}")
        elif override["registered"]:
            lines.append(
                f"{var}={value!r} overrides auto-detection, but {value!r} is not available here: "
                "get_backend() will fail"
            )
        else:
            lines.append(f"{var}={value!r} overrides auto-detection, but names no registered backend")
    if report["failures"]:
        lines.append("plugins that failed to load (skipped):")
        lines.extend(f"  {f['entry_point']} (from {f['source']}): {f['error']}" for f in report["failures"])
    return "\n".join(lines)


def run_backends(args: argparse.Namespace) -> int:
    report = backends_report()
    print(json.dumps(report, indent=2) if args.json else _render(report))
    override = report["override"]
    if override is not None and not override["registered"]:
        known = ", ".join(sorted(r["name"] for r in report["backends"])) or "none"
        raise UsageError(
            f"{override['variable']}={override['value']!r} names no registered backend; registered backends: {known}"
        )
    return 0


def add_backends(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "backends",
        help="list registered backends and the one auto-detection selects",
        description="List the registered offload backends, say which one auto-detection selects and why, "
        "and report plugins that failed to load.",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of a table")
    parser.set_defaults(run=run_backends)


# -- entry point ------------------------------------------------------------------------------

#: one function per subcommand; each adds its parser and sets ``run``
SUBCOMMANDS: list[Callable[[Any], None]] = [add_backends, add_run, add_bench, add_check_backend, add_plan]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = _Parser(prog=PROG, description="Run diffusion pipelines with CPU-offloaded weights.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in SUBCOMMANDS:
        add(subparsers)
    return parser


#: torchao's warning, at import, that its C++ kernels were built for another torch; no torchao
#: release is built for the torch CI pins, and transformers imports torchao whenever it is
#: installed (the test extras install it), so every command would print it. The commands never
#: use those kernels (torchao's quantized tensors work without them, docs/compatibility.md)
TORCHAO_ABI_WARNING = "Skipping import of cpp extensions due to incompatible torch version"


def _quiet_torchao_abi_warning(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(TORCHAO_ABI_WARNING)


#: the exit status of a command Ctrl-C stopped: 128 + SIGINT, as a shell reports it
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Console entry point: the exit status (0 ok, 2 bad input, 130 interrupted), never ``sys.exit``."""
    logging.getLogger("torchao").addFilter(_quiet_torchao_abi_warning)  # once: a filter is added once
    try:
        args = build_parser().parse_args(argv)
        return int(args.run(args))
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return INTERRUPTED
    except SystemExit as exc:  # --help and --version exit through argparse
        return exc.code if isinstance(exc.code, int) else 0
