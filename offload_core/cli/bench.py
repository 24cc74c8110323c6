"""``offload-core bench``: the benchmarks of docs/benchmarks.md as a table of ratios with their
spreads and a status, or JSON, with how busy the machine was; ``--check`` makes a missed or
unreliable figure a failure (exit 1)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from .. import bench
from ..bench.load import LoadMeter, describe
from ..bench.realscale import NotEnoughDisk, clean, default_cache_dir
from .common import UsageError, check_writable, columns, write_all


def _fmt(value: Any, spread: float | None) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    return text + (f" ± {spread:.3f}" if spread is not None else "")


def _target(row: dict[str, Any]) -> str:
    if row["target"] is None:
        return "-"
    return f"{'>=' if row['at_least'] else '<='} {row['target']:g}"


def render(results: dict[str, Any], load: dict[str, Any]) -> str:
    rows = bench.headline_rows(results)
    header = ("figure", "measured ± spread", "target", "status")
    cells = [(r["figure"], _fmt(r["value"], r["spread"]), _target(r), r["status"]) for r in rows]
    lines = [describe(load), "", *columns([header, *cells])]
    if "layerwise_overhead" in results:
        o = results["layerwise_overhead"]
        lines.append(
            f"\nper-block overhead: ours {o['ours_overhead_per_block_s'] * 1e6:.1f} us, diffusers group offloading "
            f"{o['diffusers_overhead_per_block_s'] * 1e6:.1f} us ({o['blocks']}-block tiny WanTransformer3DModel; "
            f"thread CPU time outside the block forwards, medians of {o['passes']} passes)"
        )
    lines.append("\nspread: half the interquartile range of the per-repetition ratios; status \"unreliable (machine "
                 "busy)\": the spread is wider than the distance to the target; \"unreliable (baseline too weak)\": "
                 "the figure lies beyond its physical limit by more than its spread")
    return "\n".join(lines)


def _realscale_options(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    given = [flag for flag, value in (("--dry-run", args.dry_run), ("--cache-dir", args.cache_dir)) if value]
    if "realscale" not in (args.only or []):
        if given:
            raise UsageError(f"{' and '.join(given)} apply to the realscale section: add --only realscale")
        return {}
    return {"realscale": {"dry_run": args.dry_run, "cache_dir": args.cache_dir}}


def run_bench(args: argparse.Namespace) -> int:
    if args.clean:
        cache = args.cache_dir or default_cache_dir()
        removed = clean(cache)
        print(f"removed {', '.join(removed)}" if removed else f"no realscale checkpoints in {cache}")
        return 0
    options = _realscale_options(args)
    if args.out:
        check_writable("--out", args.out)  # before minutes of benchmarks, not after
    meter = LoadMeter()
    try:
        results = bench.run(args.only, quick=args.quick, options=options)
    except NotEnoughDisk as exc:
        raise UsageError(str(exc)) from None
    load = meter.figures()
    rows = bench.headline_rows(results)
    document = {"results": results, "headlines": rows, "quick": args.quick, "load": load}
    if args.out:
        write_all([(Path(args.out), lambda to: to.write_text(json.dumps(document, indent=2), encoding="utf-8"))])
    print(json.dumps(document, indent=2) if args.json else render(results, load))
    failures = bench.failed(rows)
    if args.check and failures:
        print(f"offload-core: bench --check: {len(failures)} figure(s) missed or unreliable: "
              + "; ".join(f"{r['figure'].strip()} ({r['status']})" for r in failures), file=sys.stderr)
        return 1
    return 0


def add_bench(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run the benchmarks and print a table of ratios",
        description="Run the offloading benchmarks (docs/benchmarks.md) on the fake backend. Every figure is a "
        "ratio measured in one run with the variants interleaved, shown with its spread over the repetitions and "
        "the machine's load; a figure the run cannot vouch for is 'unreliable (machine busy)', never 'ok'.",
    )
    parser.add_argument("--only", nargs="+", choices=list(bench.SECTIONS), metavar="SECTION",
                        help=f"run only these sections: {', '.join(bench.SECTIONS)} (without it, all but "
                        f"{', '.join(bench.ON_REQUEST)})")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller stack (for smoke tests)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--out", metavar="FILE.json", help="also write the results as JSON to this file")
    parser.add_argument("--check", action="store_true",
                        help="exit 1 when a figure misses its target or is unreliable (CI use)")
    parser.add_argument("--dry-run", action="store_true",
                        help="realscale: tiny configs of the same models, in a temporary cache (CI use)")
    parser.add_argument("--cache-dir", metavar="DIR",
                        help="realscale: the folder its checkpoints are written to and reused from (default: "
                        "$XDG_CACHE_HOME/offload-core/realscale, or ~/.cache/offload-core/realscale)")
    parser.add_argument("--clean", action="store_true",
                        help="remove realscale's checkpoints from the cache folder, and run nothing")
    parser.set_defaults(run=run_bench)
