"""offload-core bench: the table and the JSON carry the measured ratios beside their targets."""

from __future__ import annotations

import json

from offload_core import bench, cli


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
    assert all(r["meets_target"] for r in rows.values())


def test_bench_table_flags_a_missed_target(capsys, monkeypatch):
    monkeypatch.setitem(bench.SECTIONS, "copies_per_block", lambda quick: {
        "fp32_copies_per_block": 2.0, "fp32+bf16_copies_per_block": 1.5,
    })
    assert cli.main(["bench", "--only", "copies_per_block"]) == 0
    table = capsys.readouterr().out
    assert "MISSED" in table and "2.000" in table


def test_unknown_section_is_a_usage_error(capsys):
    assert cli.main(["bench", "--only", "nope"]) == 2
    assert "invalid choice" in capsys.readouterr().err


def test_bench_reports_what_the_sanitizer_costs(capsys):
    assert cli.main(["bench", "--only", "sanitizer", "--quick", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)["results"]["sanitizer"]
    times = results["seconds_per_call"]
    assert times["sanitized"] > 0 and times["unsanitized"] > 0
    assert results["sanitized_to_unsanitized"] == times["sanitized"] / times["unsanitized"]


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
