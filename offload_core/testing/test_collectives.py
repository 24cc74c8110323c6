"""Conformance: ``all_gather_into_tensor`` across two spawned ranks, enqueued on a side stream.

Each rank builds its own backend (``get_backend(NAME)``, chaos mode where available), joins a
two-rank group through ``init_process_group`` and gathers rank-specific values; the result must be
exact once the returned waitable has been waited on, which is how the distributed strategy
rebuilds a block from its shards.
"""

from __future__ import annotations

import pytest
import torch

from offload_core import Capability, get_backend
from offload_core.testing import SimulatorCapability
from offload_core.testing import kit

WORLD = 2
SIZE = 1000


def _values(rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    return kit.pattern(rank + WORLD * step, SIZE, dtype)


def _rank(rank: int, name: str, chaos: bool, init_method: str) -> None:
    import torch.distributed as dist

    backend = get_backend(name, chaos=True) if chaos else get_backend(name)
    backend.init_process_group(rank, WORLD, init_method)
    try:
        side = backend.new_stream()
        for step, dtype in enumerate([torch.float32, torch.int64, torch.float32]):
            inp = kit.upload(backend, _values(rank, step, dtype))
            out = backend.empty_device(WORLD * SIZE, dtype)
            backend.wait_stream(side, backend.current_stream())
            done = backend.all_gather_into_tensor(out, inp, stream=side)
            done.wait()  # the current stream waits for the gather
            got = kit.download(backend, out)
            expected = torch.cat([_values(r, step, dtype) for r in range(WORLD)])
            assert torch.equal(got, expected), f"rank {rank} step {step}: gathered {got} != {expected}"
            done.synchronize()
            assert done.query()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        backend.close()


def test_all_gather_on_a_side_stream_across_two_ranks(backend, backend_name):
    if Capability.COLLECTIVES not in type(backend).capabilities:
        pytest.skip(f"backend {backend_name!r} has no {Capability.COLLECTIVES!r} capability")
    if backend.device_count() < WORLD:
        pytest.skip(f"backend {backend_name!r} has {backend.device_count()} device(s); the test needs {WORLD}")
    chaos = SimulatorCapability.CHAOS in type(backend).capabilities
    init_method = f"tcp://127.0.0.1:{kit.free_port()}"
    kit.spawn_ranks(_rank, WORLD, (backend_name, chaos, init_method))
