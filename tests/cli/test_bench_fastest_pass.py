"""The layerwise overhead benchmark also reports its figures from each variant's fastest pass."""

from __future__ import annotations

import math

from offload_core.bench.layerwise import overhead_per_block


def test_the_overhead_benchmark_reports_the_fastest_pass_figures():
    result = overhead_per_block(layers=4, repeats=5)
    fastest = result["fastest_pass"]
    assert fastest["diffusers_overhead_per_block_s"] > 0
    assert math.isclose(fastest["ratio_ours_to_diffusers"],
                        fastest["ours_overhead_per_block_s"] / fastest["diffusers_overhead_per_block_s"])
