"""``torchrun --nproc-per-node 2 -m offload_core run --strategy distributed``: two processes (gloo on
the fake backend) stream the DiT with the blocks sharded over the ranks; rank 0 alone reports and
writes, and the image equals the one of a run without offload."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from offload_core.device.plugins import ENV_BACKEND

from helpers import free_port

ARGS = ["--pipeline", "flux2", "--steps", "2", "--seed", "3"]


def _env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", ENV_BACKEND: "fake"}


@pytest.mark.quick
def test_two_ranks_under_torchrun_report_once_and_match_the_run_without_offload(tmp_path):
    from PIL import Image

    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    done = subprocess.run(
        [*launch, "-m", "offload_core", "run", *ARGS, "--strategy", "distributed", "--json",
         "--output", str(tmp_path / "streamed.png")],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout)  # one document: rank 1 printed nothing
    assert (report["strategy"], report["ranks"], report["prefetch_misses"]) == ("distributed", 2, 0)
    assert report["call_h2d_copies"] > 0 and report["output_files"] == [str(tmp_path / "streamed.png")]
    plain = subprocess.run(
        [sys.executable, "-m", "offload_core", "run", *ARGS, "--strategy", "none", "--json",
         "--output", str(tmp_path / "plain.png")],
        capture_output=True, text=True, env=_env(), cwd=tmp_path, timeout=240,
    )
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert np.array_equal(np.array(Image.open(tmp_path / "streamed.png")), np.array(Image.open(tmp_path / "plain.png")))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain.png", "streamed.png"]


def test_distributed_without_a_launcher_is_bad_input(capsys, monkeypatch):
    from offload_core import cli

    for variable in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(variable, raising=False)
    assert cli.main(["run", "--strategy", "distributed"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert "torchrun --nproc-per-node N -m offload_core run --strategy distributed" in err


def test_every_ranks_output_is_checked(monkeypatch):
    """A rank whose output differs fails the run (here: one process, a gather that returns a
    different tensor for the second rank)."""
    import torch
    import torch.distributed as dist

    from offload_core.cli.run import ranks

    def gathered(outputs, mine):
        outputs[0], outputs[1] = mine, mine + 1

    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "all_gather_object", gathered)
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] differ from rank 0"):
        ranks.check_outputs_equal(torch.zeros(2))
    monkeypatch.setattr(dist, "all_gather_object", lambda outputs, mine: outputs.__setitem__(slice(None), [mine, mine]))
    assert ranks.check_outputs_equal(torch.zeros(2)) == 2
