"""offload-core bench: the table and the JSON carry the measured ratios with their spreads beside
their targets, never "ok" for a figure the run cannot vouch for, and --check fails on one."""

from __future__ import annotations

import builtins
import json

import pytest

from offload_core import bench, cli
from offload_core.bench import BASELINE, UNRELIABLE, status
from offload_core.bench.load import LoadMeter
from offload_core.bench.timing import ratio, spread

pytestmark = pytest.mark.quick


def test_bench_json_reports_copies_per_block(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--only", "copies_per_block", "--json", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    written = json.loads(out.read_text())
    assert printed == written
    results = printed["results"]["copies_per_block"]
    # one copy per dtype per block: the measured copies equal the dtypes the blocks hold
    assert results["fp32_copies_per_block"] == results["fp32_dtypes_per_block"] == 1.0
    assert results["fp32+bf16_copies_per_block"] == results["fp32+bf16_dtypes_per_block"] > 1.0
    rows = {r["figure"]: r for r in printed["headlines"]}
    assert all(r["status"] == "ok" and r["spread"] is None for r in rows.values())
    assert set(printed["load"]) == {"cores", "load_average_start", "load_average_end", "cpu_steal_fraction"}


def test_bench_table_flags_a_missed_target(capsys, monkeypatch):
    monkeypatch.setitem(bench.SECTIONS, "copies_per_block", lambda quick: {
        "fp32_copies_per_block": 2.0, "fp32+bf16_copies_per_block": 1.5,
    })
    assert cli.main(["bench", "--only", "copies_per_block"]) == 0
    table = capsys.readouterr().out
    assert "MISSED" in table and "2.000" in table
    assert table.startswith("machine: ") and "load average" in table and "CPU steal" in table
    assert cli.main(["bench", "--only", "copies_per_block", "--check"]) == 1
    assert "1 figure(s) missed or unreliable" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value, spread, target, floor, expected",
    [
        (0.20, 0.02, 0.35, 0.0, "ok"),
        (0.45, 0.02, 0.35, 0.0, "MISSED"),
        (0.30, 0.10, 0.35, 0.0, UNRELIABLE),  # the spread reaches past the target
        (-0.32, 0.05, 0.35, 0.0, BASELINE),  # a negative overhead
        (0.93, 0.02, None, 1.0, BASELINE),  # offloaded faster than resident beyond the noise
        (0.98, 0.05, None, 1.0, ""),  # within the noise of the limit: reported
        (float("nan"), 0.0, 1.0, None, UNRELIABLE),
    ],
)
def test_status_never_says_ok_for_a_figure_it_cannot_vouch_for(value, spread, target, floor, expected):
    assert status(value, spread, target, floor) == expected


def test_bench_check_fails_on_an_unreliable_figure(capsys, monkeypatch):
    monkeypatch.setitem(bench.SECTIONS, "layerwise_overhead", lambda quick: {
        "ratio_ours_to_diffusers": -0.32, "spread": {"ratio_ours_to_diffusers": 0.05},
        "ours_overhead_per_block_s": -1e-4, "diffusers_overhead_per_block_s": 3e-4, "blocks": 32, "passes": 200,
    })
    assert cli.main(["bench", "--only", "layerwise_overhead"]) == 0
    table = capsys.readouterr().out
    assert "-0.320 ± 0.050" in table and BASELINE in table and " ok" not in table
    assert cli.main(["bench", "--only", "layerwise_overhead", "--check"]) == 1


def test_ratios_and_spreads_are_per_repetition():
    assert ratio([2.0, 4.0, 6.0], [1.0, 2.0, 2.0]) == (2.0, 0.25)  # ratios 2, 2, 3: median 2, IQR 0.5
    assert spread([1.0]) == 0.0


def test_the_load_meter_reads_proc_stat():
    figures = LoadMeter().figures()
    assert figures["cores"] >= 1 and figures["load_average_start"] >= 0
    assert figures["cpu_steal_fraction"] is None or 0.0 <= figures["cpu_steal_fraction"] <= 1.0


def test_the_overhead_figure_is_thread_cpu_time_outside_the_blocks(capsys):
    """The quick run: the overhead per block is positive for both libraries and the ratio comes
    with its spread."""
    assert cli.main(["bench", "--only", "layerwise_overhead", "--quick", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["results"]["layerwise_overhead"]
    assert result["passes"] == 20 and result["diffusers_overhead_per_block_s"] > 0
    assert result["spread"]["ratio_ours_to_diffusers"] >= 0


def test_unknown_section_is_a_usage_error(capsys):
    assert cli.main(["bench", "--only", "nope"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_bench_reports_what_the_sanitizer_costs(capsys):
    assert cli.main(["bench", "--only", "sanitizer", "--quick", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]["sanitizer"]
    times = results["seconds_per_call"]
    assert times["sanitized"] > 0 and times["unsanitized"] > 0
    assert results["sanitized_to_unsanitized"] > 0 and results["spread"]["sanitized_to_unsanitized"] >= 0


def test_an_unwritable_out_is_bad_input_before_any_benchmark_runs(tmp_path, capsys, monkeypatch):
    def no_run(*args, **kwargs):
        raise AssertionError("the benchmarks ran before --out was checked")

    monkeypatch.setattr(bench, "run", no_run)
    for out, problem in [
        (tmp_path / "missing" / "x.json", "does not exist"),
        (tmp_path, "is a directory"),
    ]:
        assert cli.main(["bench", "--only", "copies_per_block", "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.count("\n") == 1
        assert captured.err.startswith("offload-core: error: --out ") and problem in captured.err
    assert list(tmp_path.iterdir()) == []


def test_the_budget_curve_keeps_a_growing_share_and_copies_less(tmp_path):
    """The quick budget run keeps 0, 4, 8 and 12 of 16 blocks, spaced as the planner spaces them,
    and its figures go with them: the more kept, the closer to the resident time (timings are
    checked against their targets by ``bench --check``, not here)."""
    out = tmp_path / "budget.json"
    assert cli.main(["bench", "--only", "budget", "--quick", "--json", "--out", str(out)]) == 0
    curve = json.loads(out.read_text())["results"]["budget"]["curve"]
    assert [curve[f]["resident_blocks"] for f in ("0", "25", "50", "75")] == [0, 4, 8, 12]
    assert curve["50"]["kept"] == list(range(0, 16, 2)), "every other block: each copy hides behind two computes"
    assert [curve[f]["ideal"] for f in ("0", "25", "50", "75")] == [2.0, 1.5, 1.0, 1.0]
    assert curve["0"]["ratio"] > curve["75"]["ratio"]


def test_bench_disk_quick_reads_every_disk_block_and_reports_against_the_drive(capsys, monkeypatch):
    """The quick disk-tier run: each forward, its blocks' compute skipped or not, reads the bytes of
    the blocks on disk (counted by ``handle.stats()``); the drive's reads (O_DIRECT, 8 and 16
    requests in flight, named), just before and just after the tier alone (the faster side is its
    figure), and the buffered one read the whole checkpoint; every read starts
    with the files' pages evicted through ``POSIX_FADV_DONTNEED``, never by dropping the machine's
    page cache; its few MB judge no drive, so the throughput share is unreliable, never ok."""
    from offload_core.bench import disk as disk_bench

    evicted = []
    fadvise = disk_bench.os.posix_fadvise

    def recorded(fd, offset, length, advice):
        evicted.append(advice)
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(disk_bench.os, "posix_fadvise", recorded)
    order = []  # the drive's reads and the tier alone, as they ran
    direct_read, reader_read, skipped = disk_bench.direct_read, disk_bench.reader_read, disk_bench.compute_skipped

    reads = []  # (bytes, seconds) of each drive read as the benchmark saw it
    patterns = len(disk_bench.drive_patterns()) + 1

    def seen(read):
        """The drive's reads just before the tier made to look four times slower than those after
        it: the drive's figure must be the faster side's."""
        n, seconds = read
        reads.append((n, seconds * (4 if len(reads) // patterns % 2 == 0 else 1)))
        return reads[-1]

    def drive_read(*args, **kwargs):
        order.append("drive")
        return seen(direct_read(*args, **kwargs))

    def tier_reader(files):
        order.append("tier's reader")
        return seen(reader_read(files))

    def alone(blocks):
        order.append("tier alone")
        return skipped(blocks)

    monkeypatch.setattr(disk_bench, "direct_read", drive_read)
    monkeypatch.setattr(disk_bench, "reader_read", tier_reader)
    monkeypatch.setattr(disk_bench, "compute_skipped", alone)
    opened = builtins.open

    def no_drop_caches(path, *args, **kwargs):
        assert "drop_caches" not in str(path), "the machine's whole page cache was dropped"
        return opened(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_drop_caches)
    assert cli.main(["bench", "--only", "disk", "--quick", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    disk = printed["results"]["disk"]
    samples = disk["samples"]
    assert disk["cold_cache"] == "fadvise_dontneed" and disk_bench.os.POSIX_FADV_DONTNEED in evicted
    assert "O_DIRECT, 8 threads" in disk["raw_method"] and "O_DIRECT, 16 threads" in disk["raw_method"]
    assert disk_bench.reader_method() in disk["raw_method"]  # the tier's own requests are among the drive's
    assert disk["buffered_mb_s"] > 0
    assert set(samples["tier_bytes"]) == {disk["bytes_read_per_forward_gb"] * 1e9}
    assert samples["alone_bytes"] == samples["tier_bytes"]  # with the compute skipped, every block is read still
    assert 0 < disk["disk_bytes"] < disk["model_bytes"] <= min(samples["raw_bytes"])
    # the whole checkpoint, both ways; the drive's figure is its fastest read of the faster side
    # around the tier alone (here always the side after it)
    assert min(samples["raw_bytes"]) == min(samples["buffered_bytes"])
    sides = [reads[k : k + patterns] for k in range(0, len(reads), patterns)]
    assert samples["raw_s"] == [min(s for _, s in after) for after in sides[1::2]]
    drive = ["drive"] * len(disk_bench.drive_patterns()) + ["tier's reader"]
    assert order == [*drive, "tier alone", *drive] * disk["repeats"]
    assert samples["tier_bytes"][0] <= disk["disk_bytes"]  # what the homes hold, less alignment gaps
    assert disk["repeats"] == len(samples["tier_s"]) == 2 and disk["tier_cpu_s_per_gb"] == disk["tier_cpu_s_per_gb"]
    rows = {r["figure"]: r for r in printed["headlines"] if r["figure"].startswith(("disk", "disk-bound"))}
    assert len(rows) == 2 and all(r["status"] in ("ok", "MISSED", UNRELIABLE, BASELINE) for r in rows.values())
    share = next(r for r in rows.values() if r["at_least"])
    assert share["target"] == 0.8 and share["status"] == UNRELIABLE  # a quick run's few MB judge no drive


def test_a_ratio_beyond_its_physical_limit_is_a_baseline_too_weak_never_ok():
    """A tier faster than the drive (above 1), a forward faster than its ideal (below 1), each
    beyond its spread: the baseline was measured too low, whatever the target says."""
    assert status(1.16, 0.05, 0.8, None, at_least=True, ceiling=1.0) == BASELINE
    assert status(1.03, 0.05, 0.8, None, at_least=True, ceiling=1.0) == "ok"  # within its spread of the limit
    assert status(0.60, 0.22, 1.10, 1.0) == BASELINE and status(0.86, 0.22, 1.10, 1.0) == "ok"


def test_a_figure_held_from_below_is_ok_only_at_or_above_its_target():
    assert status(0.9, 0.02, 0.8, None, at_least=True) == "ok"
    assert status(0.6, 0.02, 0.8, None, at_least=True) == "MISSED"
    assert status(0.78, 0.05, 0.8, None, at_least=True) == UNRELIABLE


def test_the_tier_alone_loads_every_block_and_leaves_the_blocks_as_they_were(backend):
    """``compute_skipped``: inside it the offloaded forward loads every block and computes none
    of them; after it, the forward is the resident model's again, bit for bit."""
    import torch
    from diffusers import WanTransformer3DModel

    import offload_core
    from offload_core.bench.disk import compute_skipped
    from offload_core.bench.hostmem import QUICK, _inputs

    torch.manual_seed(0)
    model = WanTransformer3DModel(**QUICK).to(torch.bfloat16).eval()
    inputs = _inputs(QUICK)
    with torch.no_grad():
        expected = model(**inputs)[0]
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    blocks = list(model.blocks)
    try:
        with torch.no_grad(), compute_skipped(blocks):
            before = handle.stats()["loads"]
            skipped = model(**inputs)[0]
            assert handle.stats()["loads"] - before == len(blocks)
        assert not torch.equal(skipped, expected)
        assert all(getattr(b.forward, "__func__", None) is type(b).forward for b in blocks)
        with torch.no_grad():
            assert torch.equal(model(**inputs)[0], expected)
    finally:
        handle.disable()
