"""The disk tier's spill folder does not outlive the process: a script that spills blocks and
exits without ``disable()`` leaves nothing in the folder it named, and the log said where the
blocks were while they were there."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.quick

SCRIPT = textwrap.dedent("""
    import logging, sys
    import torch
    from torch import nn
    import offload_core

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))
    model.forward = lambda x: [x := b(x) for b in model.blocks][-1]
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend="fake", blocks=["blocks"],
                                         pin_memory=False, host_memory=0, offload_folder=sys.argv[1])
    assert handle.stats()["disk_bytes"] > 0
    with torch.no_grad():
        model(torch.randn(2, 16, device=handle.backend.device()))
    # no disable(): the process ends with the blocks still on disk
""")


def test_a_process_exiting_without_disable_removes_its_spill_folder(tmp_path):
    spill = tmp_path / "spill"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(spill)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "spilling blocks to" in line]
    assert len(said) == 1 and said[0].startswith("INFO ") and str(spill) in said[0], done.stderr
    assert spill.is_dir() and list(spill.iterdir()) == []  # the user's folder stays, emptied of ours
