"""Draw the budget benchmark's curve (docs/benchmarks.md): step time over resident against the
fraction of blocks kept on the device, measured (with its spread) and ideal.

    offload-core bench --only budget --out budget.json
    python tools/budget_png.py budget.json docs/budget.png
"""

from __future__ import annotations

import json
import sys


def draw(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    results = results["results"]
    curve = results["budget"]["curve"]
    spread = results["budget"]["spread"]
    fractions = sorted(curve, key=int)  # percent of the blocks kept
    x = [int(f) / 100 for f in fractions]
    measured = [curve[f]["ratio"] for f in fractions]
    errors = [spread[f"curve.{f}.over_ideal"] * curve[f]["ideal"] for f in fractions]
    fine = [i / 100 for i in range(0, 101)]
    ideal = [max(1.0, results["budget"]["copy_to_compute"] * (1 - f)) for f in fine]
    figure, axes = pyplot.subplots(figsize=(5.5, 3.5), dpi=100)
    axes.plot(fine, ideal, color="0.6", linestyle="--", label="ideal max(1, 2(1 - f))")
    axes.errorbar(x, measured, yerr=errors, marker="o", capsize=3, label="measured (fake backend)")
    axes.set_xlabel("fraction of blocks kept on the device")
    axes.set_ylabel("step time / all resident")
    axes.set_title(f"partial residency, copy = {results['budget']['copy_to_compute']:g} x compute "
                   f"({results['budget']['blocks']} blocks)", fontsize=10)
    axes.set_ylim(0.9, 2.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    with open(sys.argv[1]) as f:
        draw(json.load(f), sys.argv[2])
