"""offload-core bench --only realscale: its checkpoints are laid out as the libraries'
save_pretrained lays them out, written once and reused, refused up front when the disk lacks
room, removed by --clean; its dry run (what CI runs) loads both models through from_pretrained
inside the budget and matches the streaming reference bit for bit."""

from __future__ import annotations

import json
import os
from collections import namedtuple

import pytest
import torch
from safetensors import safe_open

from offload_core import cli
from offload_core.bench import realscale

WAN, UMT5 = realscale.BY_NAME["wan"], realscale.BY_NAME["umt5"]


def _layout(folder):
    """File names, and each tensor's shard, shape and dtype."""
    files = sorted(n for n in os.listdir(folder) if n.endswith((".safetensors", ".json")) and n != realscale.MARKER)
    tensors = {}
    for name in files:
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(folder, name), "pt") as f:
                for key in f.keys():
                    s = f.get_slice(key)
                    tensors[key] = (name, tuple(s.get_shape()), s.get_dtype())
    return files, tensors


@pytest.mark.parametrize("model", [WAN, UMT5], ids=["diffusers", "transformers"])
def test_checkpoints_are_laid_out_as_save_pretrained_lays_them_out(tmp_path, model):
    """The same config built normally, cast to bf16 and saved by its library with the same shard
    size: the same files, the same tensors in the same shards, and config.json's fields."""
    plan = realscale.prepare([model], str(tmp_path / "cache"), dry_run=True)[model.key]
    real = model.model_class()
    built = real(**model.tiny) if model.library == "diffusers" else real(real.config_class(**model.tiny))
    built.to(torch.bfloat16).save_pretrained(tmp_path / "saved", max_shard_size=plan["marker"]["max_shard_size"])
    ours, theirs = _layout(plan["folder"]), _layout(tmp_path / "saved")
    assert ours == theirs and len([n for n in ours[0] if n.endswith(".safetensors")]) >= 3
    index = model.weights_name + ".index.json"
    with open(os.path.join(plan["folder"], index)) as f, open(tmp_path / "saved" / index) as g:
        assert json.load(f)["weight_map"] == json.load(g)["weight_map"]
    with open(os.path.join(plan["folder"], "config.json")) as f, open(tmp_path / "saved" / "config.json") as g:
        mine, saved = json.load(f), json.load(g)
    assert {k: v for k, v in mine.items() if k != "_diffusers_version"} == \
        {k: v for k, v in saved.items() if k != "_diffusers_version"}


def test_each_tensor_gets_its_own_random_values(tmp_path):
    """Blocks of the same shape are not copies of one another (a reference that read the wrong
    block would then still match), and the values are random, not zero."""
    plan = realscale.prepare([WAN], str(tmp_path), dry_run=True)[WAN.key]
    found = {}
    for name in os.listdir(plan["folder"]):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(plan["folder"], name), "pt") as f:
                found.update({k: f.get_tensor(k) for k in f.keys() if k.endswith("attn1.to_q.weight")})
    values = list(found.values())
    assert len(values) == WAN.tiny["num_layers"] and all(v.dtype == torch.bfloat16 for v in values)
    assert all(not torch.equal(values[0], v) for v in values[1:])
    assert 0.01 < float(values[0].float().std()) < 0.04


def test_the_cache_is_reused_and_rewritten_when_its_marker_changes(tmp_path, monkeypatch):
    cache = str(tmp_path)
    first = realscale.prepare([UMT5], cache, dry_run=True)[UMT5.key]
    assert not first["cached"]
    shard = next(os.path.join(first["folder"], n) for n in os.listdir(first["folder"]) if n.endswith(".safetensors"))
    os.utime(shard, (0, 0))
    again = realscale.prepare([UMT5], cache, dry_run=True)[UMT5.key]
    assert again["cached"] and os.stat(shard).st_mtime == 0  # not written again
    monkeypatch.setattr(realscale, "CACHE_VERSION", realscale.CACHE_VERSION + 1)
    newer = realscale.prepare([UMT5], cache, dry_run=True)[UMT5.key]
    assert not newer["cached"] and os.stat(shard).st_mtime > 0


def test_too_little_disk_is_refused_before_anything_is_written(tmp_path, monkeypatch, capsys):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(realscale.shutil, "disk_usage", lambda path: usage(100 * 10**9, 90 * 10**9, 10 * 10**9))
    cache = tmp_path / "cache"
    assert cli.main(["bench", "--only", "realscale", "--cache-dir", str(cache)]) == 2
    err = capsys.readouterr().err
    # 28.6 + 11.4 GB of checkpoints and 1.1 GB to spare, against 10 GB free
    assert err.startswith("offload-core: error: realscale needs 41.0 GB free in ") and "31.0 GB missing" in err
    assert not cache.exists()


def test_clean_removes_only_the_benchmarks_checkpoints(tmp_path, capsys):
    cache = tmp_path / "cache"
    plans = realscale.prepare([WAN, UMT5], str(cache), dry_run=True)
    (cache / "mine.txt").write_text("not the benchmark's")
    assert cli.main(["bench", "--clean", "--cache-dir", str(cache)]) == 0
    assert "removed " in capsys.readouterr().out
    assert sorted(os.listdir(cache)) == ["mine.txt"] and not any(os.path.exists(p["folder"]) for p in plans.values())
    (cache / "mine.txt").unlink()
    assert cli.main(["bench", "--clean", "--cache-dir", str(cache)]) == 0
    assert "no realscale checkpoints" in capsys.readouterr().out and not cache.exists()


def test_the_realscale_options_need_the_realscale_section(capsys):
    assert cli.main(["bench", "--only", "copies_per_block", "--dry-run"]) == 2
    assert "--dry-run apply to the realscale section" in capsys.readouterr().err


def test_the_dry_run_matches_the_streaming_reference_inside_the_budget(tmp_path, capsys):
    """The CI run: both tiny models written, loaded with from_pretrained at the real run's share
    of host memory (the DiT's blocks beyond it left on disk) and compared with the reference."""
    out = tmp_path / "realscale.json"
    assert cli.main(["bench", "--only", "realscale", "--dry-run", "--check", "--json", "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    results = document["results"]["realscale"]
    for name in ("wan", "umt5"):
        r = results[name]
        assert r["outputs_equal"] and r["differing_elements"] == 0 and r["output_finite"]
        assert r["host_memory"] < r["checkpoint_bytes"] and r["offloaded"]["disk_bytes"] > 0
        assert r["host_peak_rss_over_bound"] < 1 and r["reference_peak_rss"] > 0
        assert r["host_peak_rss"] < r["peak_rss"]  # the fake device's memory is in the process's RSS
    # diffusers and transformers models alike stream from their checkpoint: no spill copy
    assert results["wan"]["offloaded"]["refused"] is None and results["umt5"]["offloaded"]["refused"] is None
    rows = [r for r in document["headlines"] if "differing" in r["figure"]]
    assert [r["status"] for r in rows] == ["ok", "ok"]
    assert not os.path.exists(results["cache_dir"])  # the dry run's cache is temporary


def test_plain_bench_does_not_run_realscale(monkeypatch, capsys):
    """Without --only, every section but realscale runs: a plain bench never writes 40 GB."""
    from offload_core import bench

    ran = []
    for name in bench.SECTIONS:
        monkeypatch.setitem(bench.SECTIONS, name, lambda quick, name=name: ran.append(name) or {})
    assert cli.main(["bench", "--json"]) == 0
    assert ran == [name for name in bench.SECTIONS if name != "realscale"] and ran
