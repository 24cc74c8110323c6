"""Two gloo ranks on the fake backend, each run bounded in time (a hang fails the test instead of
blocking the suite), and the four-block stack they offload: shared by the distributed contract
tests."""

from __future__ import annotations

import datetime
import sys
import time

import pytest
import torch
import torch.multiprocessing as mp

from helpers import free_port

WORLD = 2
SECONDS = 240  # generous for a loaded machine; a hang shows up as a failure, not a stuck suite


def spawn_bounded(fn, *args) -> None:
    context = mp.spawn(fn, args=(free_port(), *args), nprocs=WORLD, join=False)
    deadline = time.monotonic() + SECONDS
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"ranks still running after {SECONDS} s: a hang")


def join_ranks(rank: int, port: int):
    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    torch.set_num_threads(1)
    import offload_core

    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001)
    backend.init_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}", timeout=datetime.timedelta(seconds=60))
    return backend


def four_blocks(seed: int = 0, counting: bool = False):
    """Four blocks of one shape (so that mismatched gathers pair up, the dangerous case); with
    ``counting``, each block has a layer whose forward updates buffers."""
    from contract_models import Counting
    from stacks import Block, Layer, Stack

    g = torch.Generator().manual_seed(seed)
    blocks = [
        Block([Layer(8, torch.float32, i % 2 == 1, g), *([Counting(8, g)] if counting else [])]) for i in range(4)
    ]
    return Stack(8, blocks, g).eval()


def run_step(model, step: int):
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(step))
    with torch.no_grad():
        return model(x).clone()

