"""``offload-core bench``: the benchmarks of docs/benchmarks.md as a table of ratios, or JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from . import bench
from .cli_common import check_writable, columns, write_all


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}"
    return str(value)


def render(results: dict[str, Any]) -> str:
    rows = bench.headline_rows(results)
    header = ("figure", "measured", "target", "")
    cells = [
        (r["figure"], _fmt(r["value"]), "-" if r["target"] is None else f"<= {r['target']:g}",
         "" if r["meets_target"] is None else ("ok" if r["meets_target"] else "MISSED"))
        for r in rows
    ]
    lines = columns([header, *cells])
    if "layerwise_overhead" in results:
        o = results["layerwise_overhead"]
        lines.append(
            f"\nper-block overhead: ours {o['ours_overhead_per_block_s'] * 1e6:.1f} us, diffusers group offloading "
            f"{o['diffusers_overhead_per_block_s'] * 1e6:.1f} us ({o['blocks']}-block tiny WanTransformer3DModel)"
        )
    return "\n".join(lines)


def run_bench(args: argparse.Namespace) -> int:
    if args.out:
        check_writable("--out", args.out)  # before minutes of benchmarks, not after
    results = bench.run(args.only, quick=args.quick)
    document = {"results": results, "headlines": bench.headline_rows(results), "quick": args.quick}
    if args.out:
        write_all([(Path(args.out), lambda to: to.write_text(json.dumps(document, indent=2), encoding="utf-8"))])
    print(json.dumps(document, indent=2) if args.json else render(results))
    return 0


def add_bench(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="run the benchmarks and print a table of ratios",
        description="Run the offloading benchmarks (docs/benchmarks.md) on the fake backend. Every figure is a "
        "ratio measured in one run with the variants interleaved.",
    )
    parser.add_argument("--only", nargs="+", choices=list(bench.SECTIONS), metavar="SECTION",
                        help=f"run only these sections: {', '.join(bench.SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and a smaller stack (for smoke tests)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--out", metavar="FILE.json", help="also write the results as JSON to this file")
    parser.set_defaults(run=run_bench)
