"""What a first GPU run would trip over, checked here: the strategies' side of the fixes made
before it (issue 22). Pageable copies are blocking on purpose and reported; the stager thread binds
to the enabling thread's device; distributed ranks issue their gathers in the same order when a
rank fails with staged shards; model-level prefetch leaves room for what the active group's
compute took on its first call; slot views are aligned as the CUDA caching allocator aligns.

The device-module side (host-cache emptying by each torch's names, ``compiler.disable``'s
``reason=``, the collective fallback, ``bind_thread``) is in test_accelerator_backends.py."""

from __future__ import annotations

import datetime
import sys
import threading
import time

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn

import offload_core
from offload_core.hostmem import staging
from offload_core.hostmem.placement import Placement
from offload_core.common.transaction import Transaction
from offload_core.strategies.model_level import RESERVE_FRACTION, ModelLevelOffload
from offload_core.weights.unit import ALIGN_BYTES

from helpers import chaos_backend, free_port
from stacks import StackSpec, build_stack

# the fake's own recording (bound_threads) and capacity options: simulator tests
pytestmark = pytest.mark.fake_only

MIXED = [[torch.float32, torch.bfloat16], [torch.float16], [torch.float32], [torch.bfloat16]]
X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def _stack():
    return build_stack(StackSpec(d=8, layer_dtypes=MIXED, transposed=True, tie_within=True, tie_head=True))


def _run(model, x=X):
    with torch.no_grad():
        return model(x).clone()


# -- pageable homes: blocking copies on the stager thread, reported ------------------------------


def _copy_threads(monkeypatch, backend) -> list[tuple[str, bool]]:
    """(thread name, source pinned) of every host-to-device copy the backend is asked for."""
    seen: list[tuple[str, bool]] = []
    copy = backend.copy_async

    def recording(dst, src, stream=None):
        if src.device.type == "cpu" and not backend._device.owns(src):
            seen.append((threading.current_thread().name, backend.is_pinned(src)))
        return copy(dst, src, stream)

    monkeypatch.setattr(backend, "copy_async", recording)
    return seen


def _waited_for(monkeypatch) -> list[bool]:
    """Whether the copy stream had run everything queued on it when each blocking copy returned."""
    done: list[bool] = []
    blocking_copy = Placement._blocking_copy

    def checked(self, dst, src, stream):
        blocking_copy(self, dst, src, stream)
        done.append(stream.query())

    monkeypatch.setattr(Placement, "_blocking_copy", checked)
    return done


def test_pageable_homes_are_copied_blocking_on_the_stager_thread_and_reported(monkeypatch):
    model = _stack()
    expected = [_run(model, X + i) for i in range(3)]
    backend = chaos_backend()
    waited = _waited_for(monkeypatch)
    seen = _copy_threads(monkeypatch, backend)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend, pin_memory=False)
    seen.clear()  # the resident weights' one copy at enable
    for i in range(3):
        assert torch.equal(_run(model, X + i), expected[i])
    stats = handle.stats()
    assert seen and {name for name, _ in seen} == {"offload-core-stager"}, "pageable copies on the compute thread"
    assert stats["blocking_copy_bytes"] == stats["h2d_bytes"] > 0
    assert waited and all(waited), "a blocking copy returned before its copy had run"
    handle.disable()


def test_a_pageable_bounce_ring_copies_blocking_and_reports_it(tmp_path, monkeypatch):
    monkeypatch.setattr(staging, "BOUNCE_CHUNK_BYTES", 64)
    waited = _waited_for(monkeypatch)
    model = _stack()
    expected = [_run(model, X + i) for i in range(2)]
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         pin_memory=False, host_memory=0, offload_folder=tmp_path)
    for i in range(2):
        assert torch.equal(_run(model, X + i), expected[i])
    stats = handle.stats()
    assert stats["disk_bytes"] > 0 and stats["pinned_host_bytes"] == 0
    assert stats["blocking_copy_bytes"] >= stats["staged_bytes"] > 0
    assert waited and all(waited), "a copy from a pageable bounce buffer returned before it had run"
    handle.disable()


def test_pinned_homes_are_not_blocking_copies():
    model = _stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    _run(model)
    assert handle.stats()["blocking_copy_bytes"] == 0 and handle.parts[0].placement.stager is None
    handle.disable()


# -- the stager thread is bound to the enabling thread's device ---------------------------------


def test_the_stager_thread_binds_to_the_device_before_its_first_load(monkeypatch):
    backend = chaos_backend()
    order: list[str] = []
    bind = backend.bind_thread
    monkeypatch.setattr(backend, "bind_thread", lambda device: (order.append("bind"), bind(device)))
    submit = staging.Stager.submit
    monkeypatch.setattr(staging.Stager, "submit", lambda self, task: submit(self, lambda: (order.append("task"), task())))
    model = _stack()
    expected = _run(model)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend, pinned_memory=0)
    assert torch.equal(_run(model), expected)
    handle.disable()
    assert backend.bound_threads == [("offload-core-stager", backend.device())]
    assert order[0] == "bind" and order.count("bind") == 1 and "task" in order


def test_a_stager_that_cannot_bind_fails_every_load_with_that_error():
    def refuse():
        raise RuntimeError("device 3 is not available")

    stager = staging.Stager(on_start=refuse)
    ran: list[int] = []
    ticket = stager.submit(lambda: ran.append(1))
    with pytest.raises(staging.StagingError, match="device 3 is not available"):
        stager.wait(ticket)
    assert ran == []
    stager.close()


# -- distributed, staged shards: the same collectives in the same order on every rank -------------

WORLD = 2


def _headers_worker(rank: int, port: int) -> None:
    """Rank 0 fails in block 1 while the stager is still behind with block 2's load: the headers
    each rank gathers, in the order it issues them, must pair up, and rank 0's loads after its
    failure must say so."""
    sys.path.insert(0, __file__.rsplit("/", 2)[0])
    torch.set_num_threads(1)
    from contract_models import raise_once

    from offload_core.strategies.gather import ABORTED, END, OK

    backend = chaos_backend()
    backend.init_process_group(rank, WORLD, f"tcp://127.0.0.1:{port}", timeout=datetime.timedelta(seconds=30))
    staging.BOUNCE_CHUNK_BYTES = 64
    submit = staging.Stager.submit

    def behind(self, task):  # every load starts late: the stager's queue is behind compute
        return submit(self, lambda: (time.sleep(0.05), task()))

    staging.Stager.submit = behind
    model = _stack()
    expected = [_run(model, X + i) for i in range(2)]
    handle = offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend,
                                         pinned_memory=0)
    part = handle.parts[0]
    issued: list[tuple[int, int]] = []
    gather = part.transport._gather_header
    part.transport._gather_header = lambda i, status: (issued.append((i, status)), gather(i, status))[1]
    assert torch.equal(_run(model, X), expected[0])
    issued.clear()
    if rank == 0:
        model.blocks[1].layers[0].register_forward_pre_hook(raise_once(RuntimeError("this rank fails")))
        with pytest.raises(RuntimeError, match="this rank fails"):
            _run(model, X + 1)
    else:
        with pytest.raises(offload_core.DistributedOffloadError, match="rank 0 failed during this forward"):
            _run(model, X + 1)
    everyone: list = [None] * WORLD
    torch.distributed.all_gather_object(everyone, issued)
    blocks = [[i for i, _ in sequence] for sequence in everyone]
    assert blocks[0] == blocks[1], f"ranks issued their gathers in different orders: {blocks}"
    assert blocks[0][-1] == END and len(set(blocks[0][:-1])) == len(blocks[0]) - 1, blocks[0]
    statuses = dict(everyone[0][:-1])
    assert statuses[3] == ABORTED, f"rank 0's load of a block after its failure went out as OK: {everyone[0]}"
    assert all(status == OK for _, status in everyone[1]), everyone[1]
    assert torch.equal(_run(model, X + 1), expected[1]), f"rank {rank}: the forward after a failure"
    handle.disable()


def test_staged_shards_abort_and_drain_in_the_same_order_on_every_rank():
    context = mp.spawn(_headers_worker, args=(free_port(),), nprocs=WORLD, join=False)
    deadline = time.monotonic() + 180
    while not context.join(timeout=1.0):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("ranks still running after 180 s: a hang (gathers issued in different orders)")


# -- model-level: room for the active group's compute, measured on its first call --------------

K = 64  # a KxK float32 Linear without bias: 16 KiB


def _two_groups(backend, activation_bytes: int):
    """Groups a and b; a's forward takes ``activation_bytes`` of device memory while it runs."""
    torch.manual_seed(0)
    a, b = nn.Linear(K, K, bias=False), nn.Linear(K, K, bias=False)
    part = ModelLevelOffload([("a", [("a", a)]), ("b", [("b", b)])], backend)
    with Transaction() as txn:
        part.enable(txn)
    seen: list[str] = []  # b's state while a computes: "loading" means prefetched beside it

    def computing(module, args):
        seen.append(part.groups[1].state)
        scratch = backend.empty_device(activation_bytes)  # raises if a prefetch took the room
        del scratch

    a.register_forward_pre_hook(computing)
    return part, a, b, seen


@pytest.mark.parametrize("activations, prefetched", [(0.25, ["host", "loading", "loading"]),
                                                     (2.5, ["host", "host", "host"])])
def test_model_level_prefetch_leaves_room_for_what_the_active_group_took_on_its_first_call(activations,
                                                                                              prefetched):
    group = K * K * 4
    capacity = 4 * group
    # the fixed reserve alone would let b in beside a: with a's 2.5 groups of activations that
    # is 4.5 groups on a device of 4, an out-of-memory error inside a's forward
    assert group <= capacity - group - RESERVE_FRACTION * capacity
    backend = offload_core.get_backend("fake", chaos=True, chaos_delay=0.001, device_memory=capacity)
    part, a, b, seen = _two_groups(backend, int(activations * group))
    x = torch.randn(2, K)
    with torch.no_grad():
        expected = x @ a.weight.detach().clone().T @ b.weight.detach().clone().T
        for _ in range(3):
            y = b(a(x))
            part.release_all()
    assert seen == prefetched
    assert torch.equal(y, expected)
    part.disable()


# -- slot views aligned as the caching allocator aligns ----------------------------------------


def test_slot_views_start_at_512_byte_boundaries_as_the_caching_allocator_aligns():
    assert ALIGN_BYTES == 512  # cuBLAS picks kernels by alignment: views must look like allocations
    d = 24  # 24 * 24 * 2 bytes: a bf16 weight is not a multiple of 512 bytes, so packing must pad
    model = build_stack(StackSpec(d=d, layer_dtypes=[[torch.float32, torch.bfloat16, torch.bfloat16]] * 3))
    offsets: list[int] = []

    def record(module, args):
        offsets.extend(p.storage_offset() * p.element_size() for p in module.parameters())

    for block in model.blocks:
        block.register_forward_pre_hook(record)
    x = torch.randn(2, d, generator=torch.Generator().manual_seed(0))
    expected = _run(model, x)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    offsets.clear()
    assert torch.equal(_run(model, x), expected)
    assert len(offsets) == 9 and any(offsets)
    assert [o for o in offsets if o % 512] == []
    handle.disable()

