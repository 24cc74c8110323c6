"""``offload-core run``: run a pipeline once with offloading and report what it cost.

One module per job: :mod:`.arguments` (the parser and every check that needs no model),
:mod:`.loading` (building or loading the pipeline), :mod:`.command` (the timed, traced call and the
error contract), :mod:`.report` (the figures, the table, the verdict), :mod:`.outputs` (the files,
all or none) and :mod:`.drawing` (the ``--timeline`` picture). Only :mod:`.arguments` is
imported to build the parser; the rest (torch, diffusers) when the command runs.
"""

from __future__ import annotations

import argparse
from typing import Any

from .arguments import HELP_EPILOG, STRATEGY_CHOICES, add_arguments

__all__ = ["STRATEGY_CHOICES", "add_run", "run_command"]


def run_command(args: argparse.Namespace) -> int:
    from .command import run_command as run

    return run(args)


def add_run(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a pipeline once with offloading and report memory, transfers and overlap",
        description="Run a diffusion pipeline once with CPU offloading and report the time per denoising step,\n"
        "the device memory saved, bytes moved, prefetch misses and copy/compute overlap.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(run=run_command)
