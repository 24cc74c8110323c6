"""Host memory: the pinned budget and its bounce ring, the disk tier, loading straight from a
checkpoint with ``from_pretrained``, and no second copy of the model anywhere."""

from __future__ import annotations

import os
import re
import sys
import threading
import time
import weakref

import pytest
import torch
import torch.multiprocessing as mp

import offload_core
from offload_core_fake import StreamRaceError
from offload_core.discovery import find_blocks
from offload_core.common.config import parse_budget
from offload_core.hostmem import placement, staging
from offload_core.hostmem.disk import FileSlice
from offload_core.strategies.layerwise import LayerwiseOffload
from offload_core.strategies.resident import ResidentModules
from offload_core.hostmem import slabs as slabs_module
from offload_core.weights import split_units
from offload_core.hostmem.slabs import aligned
from offload_core.weights.unit import WeightUnit

from helpers import assert_same_state, chaos_backend, forward, free_port, snapshot
from stacks import StackSpec, build_stack

MIXED = [[torch.float32, torch.bfloat16], [torch.float16], [torch.float32, torch.float32], [torch.bfloat16],
         [torch.float32]]
X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


def mixed_stack():
    return build_stack(StackSpec(d=8, layer_dtypes=MIXED, transposed=True, tie_within=True, tie_head=True))


def run(model, x=X):
    with torch.no_grad():
        return model(x)


def unit_bytes(model) -> tuple[int, list[int]]:
    resident, units = split_units(model, find_blocks(model))
    return resident.nbytes, [u.nbytes for u in units]


def pinned_cost(unit) -> int:
    """What a unit's home takes in a pinned slab: its buffers, each at an aligned offset."""
    return sum(aligned(n * dtype.itemsize) for dtype, n in unit.numel.items())


@pytest.fixture
def small_chunks(monkeypatch):
    """Bounce buffers of 64 bytes: every block of a small stack takes several chunks and the ring
    wraps often."""
    monkeypatch.setattr(staging, "BOUNCE_CHUNK_BYTES", 64)


@pytest.fixture
def slow_stager(monkeypatch):
    """Chaos for the stager thread: each staged copy starts 2 ms late, so that a wait missing on
    the thread that hands loads to the stager shows every time, not when the threads happen to
    interleave badly (the fake's chaos mode delays its streams, not our thread)."""
    stage = staging.BounceRing.stage

    def late(self, *args):
        time.sleep(0.002)
        stage(self, *args)

    monkeypatch.setattr(staging.BounceRing, "stage", late)


class HeldTasks:
    """Holds back the stager's tasks submitted while ``method`` of ``cls`` runs: each starts only
    once ``release`` is set (or half a second has passed), and ``finished`` records when each
    ended, failed or not. A wait missing between the stager and the model's thread then lets the
    model's thread pass every time, whatever the threads' timing."""

    def __init__(self, monkeypatch, cls: type, method: str) -> None:
        self.release = threading.Event()
        self.finished: list[float] = []
        holding = threading.Event()
        submit, original = staging.Stager.submit, getattr(cls, method)

        def held_back_submit(stager, task):
            if not holding.is_set():
                return submit(stager, task)

            def held_back():
                self.release.wait(timeout=0.5)
                try:
                    task()
                finally:
                    self.finished.append(time.monotonic())

            return submit(stager, held_back)

        def holding_method(*args, **kwargs):
            holding.set()
            try:
                return original(*args, **kwargs)
            finally:
                holding.clear()

        monkeypatch.setattr(staging.Stager, "submit", held_back_submit)
        monkeypatch.setattr(cls, method, holding_method)


# -- options ------------------------------------------------------------------------------------
@pytest.mark.parametrize("value, nbytes", [
    (0, 0), (1000, 1000), ("12GiB", 12 * 2**30), ("512MB", 512 * 10**6), ("1.5 KiB", 1536), ("auto", None),
    (None, None), (0.25, 2**38),
])
def test_budget_forms(value, nbytes):
    assert parse_budget(value).resolve(physical=2**40) == nbytes


@pytest.mark.parametrize("options, match", [
    ({"pinned_memory": -1}, "pinned_memory"),
    ({"pinned_memory": "12 parsecs"}, "pinned_memory"),
    ({"host_memory": 1.5}, "host_memory.*fraction"),
    ({"host_memory": True}, "host_memory"),
    ({"host_memory": [1]}, "host_memory"),
    ({"pin_memory": False, "pinned_memory": "1GiB"}, "pin_memory=False"),
    ({"offload_folder": 3}, "offload_folder"),
])
def test_invalid_host_options_are_config_errors_that_leave_the_model_untouched(options, match):
    model = mixed_stack()
    before = snapshot(model)
    with pytest.raises(offload_core.OffloadConfigError, match=match):
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(), **options)
    assert_same_state(before, snapshot(model))


def test_the_disk_tier_is_refused_where_it_does_not_apply_or_has_nowhere_to_read_from():
    model = mixed_stack()
    before = snapshot(model)
    with pytest.raises(offload_core.OffloadConfigError, match="host_memory.*layerwise"):
        offload_core.enable_offload(model, enable_cpu_offload=True, backend=chaos_backend(), host_memory=0)
    with pytest.raises(offload_core.OffloadConfigError, match="offload_folder"):
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(), host_memory=0)
    assert_same_state(before, snapshot(model))
    assert not any(m._forward_pre_hooks or "forward" in m.__dict__ for m in model.modules())


# -- pinned budget and bounce ring --------------------------------------------------------------
def test_a_pinned_budget_stages_the_other_blocks_through_the_bounce_ring_exactly(small_chunks, slow_stager):
    model = mixed_stack()
    before = snapshot(model)
    expected = [run(model, X + i) for i in range(3)]
    resident, blocks = unit_bytes(model)
    costs = [pinned_cost(u) for u in split_units(model, find_blocks(model))[1]]
    ring = staging.BOUNCE_BUFFERS * 64
    pinned = staging.BOUNCE_BUFFERS * aligned(64) + costs[0] + costs[1]  # the ring first, then blocks in order
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend, pinned_memory=pinned)
    stats = handle.stats()
    assert stats["pinned_host_bytes"] == backend.pinned_memory_allocated() == pinned
    assert stats["bounce_bytes"] == ring
    assert stats["pageable_host_bytes"] == resident + sum(blocks[2:])
    for _ in range(2):
        for i in range(3):
            assert torch.equal(run(model, X + i), expected[i])
    stats = handle.stats()
    assert stats["prefetch_misses"] == 0
    handle.placement.drain()
    assert handle.stats()["staged_bytes"] > sum(blocks[2:])
    handle.disable()
    assert_same_state(before, snapshot(model))
    assert backend.pinned_memory_allocated() == 0


def test_disable_unpacks_only_once_every_load_handed_to_the_stager_is_issued(small_chunks, monkeypatch):
    """Inside ``frozen()`` a forward ends by handing the next forward's first loads to the stager;
    a disable right after must wait for them before it gives any home back (they read the homes).
    Those loads are held back until unpacking starts (or half a second has passed), so a disable
    that does not wait for them shows every time, whatever the threads' timing."""
    model = mixed_stack()
    expected = run(model, X)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         pinned_memory=0)
    held = HeldTasks(monkeypatch, LayerwiseOffload, "_load_first")
    unpack, unpacked = WeightUnit.unpack, []

    def counted_unpack(self, *args):
        unpacked.append(time.monotonic())
        held.release.set()
        unpack(self, *args)

    monkeypatch.setattr(WeightUnit, "unpack", counted_unpack)
    with handle.frozen():
        assert torch.equal(run(model, X), expected)
        handle.disable()
    assert held.finished, "the forward handed no load to the stager"
    assert unpacked and max(held.finished) < min(unpacked)
    assert torch.equal(run(model, X), expected)


def test_removing_the_bounce_buffer_wait_is_reported_as_a_race(small_chunks):
    """The sanitizer sees the stager refill a bounce buffer that a queued copy has yet to read."""
    model = mixed_stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         pinned_memory=0)
    for event in handle.placement.ring.read_done:
        event.synchronize = lambda: None
    with pytest.raises(staging.StagingError) as failure:
        for _ in range(2):
            run(model)
    race = failure.value.__cause__
    assert isinstance(race, StreamRaceError) and "write-after-read" in str(race)
    assert re.search(r"this access: +write by host aten\.copy_.*\n.*at offload_core/weights/unit\.py", str(race))
    assert re.search(r"earlier access: +read by copy_async \(H2D\).*\n.*at offload_core/hostmem/staging\.py",
                     str(race))
    handle.disable()


@pytest.mark.unsanitized("shows that chaos mode alone also sees a bounce buffer refilled too early")
def test_removing_the_bounce_buffer_wait_gives_wrong_output_under_chaos(small_chunks):
    """Proves the tests see a bounce buffer overwritten before the copy that reads it has run."""
    model = mixed_stack()
    expected = run(model)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         pinned_memory=0)
    assert torch.equal(run(model), expected)
    for event in handle.placement.ring.read_done:
        event.synchronize = lambda: None
    assert not torch.equal(run(model), expected)
    handle.disable()


def test_out_of_order_calls_of_staged_blocks_are_exact(small_chunks):
    model = mixed_stack()
    blocks = [b for _, b in find_blocks(model)]
    order = [4, 0, 2, 2, 1, 3]

    def run_in(order):
        with torch.no_grad():
            x = model.embed(X)
            for i in order:
                x = blocks[i](x)
            return model.head(x)

    expected = run_in(order)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         pinned_memory=0, prefetch_depth=2)
    assert torch.equal(run_in(order), expected)
    assert torch.equal(run_in(order), expected)
    assert handle.stats()["prefetch_misses"] >= 3
    handle.disable()


@pytest.mark.parametrize("options", [
    {"enable_cpu_offload": True},
    {"enable_layerwise_offload": True},
    {"enable_layerwise_offload": True, "components": ("dit", "text_encoder", "vae")},
], ids=["model-level", "layerwise-resident-rest", "layerwise-all-groups"])
def test_pipeline_components_without_pinned_memory_are_staged_exactly(tiny_wan, kib_chunks, slow_stager, options):
    handle = offload_core.enable_offload(tiny_wan.pipe, backend=chaos_backend(), pinned_memory=0, **options)
    for _ in range(2):
        assert torch.equal(tiny_wan.run(seed=0), tiny_wan.expected)
    assert handle.stats()["pinned_host_bytes"] == handle.stats()["bounce_bytes"] > 0
    handle.disable()
    assert torch.equal(tiny_wan.run(seed=0), tiny_wan.expected)


def test_resident_components_are_on_the_device_when_enable_returns(tiny_wan, kib_chunks, monkeypatch):
    """Components kept on the device whose homes are not pinned are copied by the stager; enable
    returns only once those copies were issued and have landed. The stager's tasks from that step
    are held back until enable has returned (or half a second has passed), so an enable that does
    not wait for them shows every time, whatever the threads' timing."""
    held = HeldTasks(monkeypatch, ResidentModules, "enable")
    handle = offload_core.enable_offload(tiny_wan.pipe, enable_layerwise_offload=True, backend=chaos_backend(),
                                         pinned_memory=0)
    returned = time.monotonic()
    held.release.set()
    handle.placement.drain()
    try:
        assert held.finished and max(held.finished) < returned
        assert torch.equal(tiny_wan.run(seed=0), tiny_wan.expected)
    finally:
        handle.disable()


def test_a_staged_resident_part_is_on_the_device_when_enable_returns(small_chunks, monkeypatch):
    """Layerwise: the weights outside the blocks, with no pinned home, are copied by the stager;
    enable returns only once that copy was issued and has landed (the stager's tasks of enable are
    held back until it returned, or half a second has passed, so a missing wait shows every time)."""
    model = mixed_stack()
    expected = run(model, X)
    # a first enable pays the one-time imports (Dynamo), which must not count against the hold
    offload_core.enable_offload(mixed_stack(), enable_layerwise_offload=True, backend=chaos_backend()).disable()
    held = HeldTasks(monkeypatch, LayerwiseOffload, "enable")
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         pinned_memory=0)
    returned = time.monotonic()
    held.release.set()
    handle.placement.drain()
    try:
        assert held.finished and max(held.finished) < returned
        assert torch.equal(run(model, X), expected)
    finally:
        handle.disable()


@pytest.fixture(scope="module")
def tiny_wan():
    from offload_core.tiny import build_pipeline

    tiny = build_pipeline("wan2.2-t2v")
    tiny.expected = tiny.run(seed=0)
    return tiny


# -- disk tier ----------------------------------------------------------------------------------
def test_blocks_beyond_host_memory_are_spilled_and_streamed_from_disk(tmp_path, small_chunks):
    model = mixed_stack()
    before = snapshot(model)
    expected = [run(model, X + i) for i in range(3)]
    resident, blocks = unit_bytes(model)
    ring = staging.BOUNCE_BUFFERS * aligned(64)  # as it takes pinned memory: each buffer aligned
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         host_memory=resident + ring + blocks[0], offload_folder=tmp_path)
    spilled = sorted(p.name for p in tmp_path.rglob("*.safetensors"))
    assert len(spilled) == len(blocks) - 1 and all("blocks." in name for name in spilled)
    stats = handle.stats()
    assert stats["disk_bytes"] == sum(blocks[1:])
    assert stats["host_bytes"] == resident + blocks[0]
    for _ in range(2):
        for i in range(3):
            assert torch.equal(run(model, X + i), expected[i])
    state = model.state_dict()  # blocks on disk answer from their files
    for key, (_, value, *_) in before["tensors"].items():
        if key in state:
            assert torch.equal(state[key], value), key
    handle.disable()
    assert_same_state(before, snapshot(model))
    assert not list(tmp_path.rglob("*.safetensors"))


def test_a_fraction_of_ram_is_taken_of_the_ram_of_the_machine_that_plans(tmp_path, small_chunks, monkeypatch):
    """host_memory=0.25 on a machine whose RAM is four times what the resident weights, the bounce
    ring and the first block take: that block stays in RAM, the others go to disk."""
    model = mixed_stack()
    expected = run(model)
    resident, blocks = unit_bytes(model)
    ring = staging.BOUNCE_BUFFERS * aligned(64)  # as it takes pinned memory: each buffer aligned
    monkeypatch.setattr(placement, "physical_memory", lambda: 4 * (resident + ring + blocks[0]))
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         host_memory=0.25, pinned_memory="1GiB", offload_folder=tmp_path)
    try:
        stats = handle.stats()
        assert (stats["host_bytes"], stats["disk_bytes"]) == (resident + blocks[0], sum(blocks[1:]))
        assert torch.equal(run(model), expected)
    finally:
        handle.disable()


def test_a_failed_enable_with_spilled_blocks_restores_them_and_removes_the_files(tmp_path, monkeypatch):
    model = mixed_stack()
    before = snapshot(model)

    def fail(self, i, ready, ticket=None):
        assert list(tmp_path.rglob("*.safetensors"))  # the blocks are on disk by now
        raise RuntimeError("a failure after spilling")

    monkeypatch.setattr(LayerwiseOffload, "_load_record", fail)
    with pytest.raises(RuntimeError, match="after spilling"):
        offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(), host_memory=0,
                                    offload_folder=tmp_path)
    assert_same_state(before, snapshot(model))
    assert not list(tmp_path.rglob("*.safetensors"))


# -- from_pretrained ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wan_folder(tmp_path_factory):
    """A tiny Wan 2.2 pipeline saved as diffusers saves one (fp32 safetensors)."""
    from offload_core.tiny import build_pipeline

    folder = tmp_path_factory.mktemp("wan22")
    build_pipeline("wan2.2-t2v").pipe.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("options", [{}, {"pinned_memory": 0}, {"host_memory": 0}], ids=["pinned", "staged", "disk"])
def test_from_pretrained_pipeline_equals_diffusers_load(wan_folder, kib_chunks, options):
    """Both DiTs are read straight from the checkpoint (converted to bf16 on the way, fp32
    modules kept); the text encoder and the rest load as diffusers loads them."""
    import diffusers
    from offload_core.tiny import TinyPipeline, build_pipeline

    call = build_pipeline("wan2.2-t2v").call_kwargs
    reference = diffusers.WanPipeline.from_pretrained(wan_folder, dtype=torch.bfloat16)
    reference.set_progress_bar_config(disable=True)
    expected = TinyPipeline("ref", reference, call, "frames").run(seed=0)
    handle = offload_core.from_pretrained(wan_folder, torch_dtype=torch.bfloat16, enable_layerwise_offload=True,
                                          backend=chaos_backend(), **options)
    pipe = handle.target
    assert type(pipe).__name__ == "WanPipeline" and handle.strategy == "layerwise"
    pipe.set_progress_bar_config(disable=True)
    for name in ("transformer", "transformer_2"):
        assert [(n, p.dtype, p.shape) for n, p in getattr(pipe, name).named_parameters()] == \
            [(n, p.dtype, p.shape) for n, p in getattr(reference, name).named_parameters()]
    tiny = TinyPipeline("offloaded", pipe, call, "frames")
    for _ in range(2):
        assert torch.equal(tiny.run(seed=0), expected)
    if "host_memory" in options:
        assert handle.stats()["disk_bytes"] == sum(u.nbytes for p in handle.parts[:2] for u in p.units)
    handle.disable()
    assert torch.equal(tiny.run(seed=0), expected)


def test_from_pretrained_model_reads_each_tensor_once_into_its_home(tmp_path, monkeypatch):
    """No intermediate copy: diffusers' state-dict loader never runs, and each checkpoint tensor
    is read exactly once, into the unit's pinned home."""
    from diffusers import WanTransformer3DModel
    from diffusers.models import modeling_utils
    from denoisers import build_transformer

    model, inputs = build_transformer("wan-t2v")
    model.save_pretrained(tmp_path)
    reference = WanTransformer3DModel.from_pretrained(tmp_path)
    expected = forward(reference, inputs)
    reads: list[int] = []
    read = FileSlice.read
    monkeypatch.setattr(FileSlice, "read", lambda self, *a: (reads.append(id(self)), read(self, *a))[1])
    monkeypatch.setattr(modeling_utils, "load_state_dict", lambda *a, **k: pytest.fail("diffusers loaded"))
    backend = chaos_backend()
    handle = offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, backend=backend)
    loaded = handle.target
    assert isinstance(loaded, WanTransformer3DModel) and not loaded.training
    assert len(reads) == len(set(reads)) == len(reference.state_dict())
    part = handle.parts[0]
    homes = sum(pinned_cost(u) for u in (part.resident, *part.units))
    assert backend.pinned_memory_allocated() == handle.stats()["pinned_host_bytes"] == homes
    for _ in range(2):
        assert torch.equal(forward(loaded, inputs), expected)
    handle.disable()
    assert torch.equal(forward(loaded, inputs), expected)
    monkeypatch.undo()
    handle = offload_core.from_pretrained(tmp_path, enable_cpu_offload=True, backend=chaos_backend())
    assert torch.equal(forward(handle.target, inputs), expected)
    handle.disable()


def test_from_pretrained_reads_a_sharded_checkpoint_and_streams_its_blocks_from_the_shards(tmp_path):
    from diffusers import WanTransformer3DModel
    from denoisers import build_transformer

    model, inputs = build_transformer("wan-t2v")
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    expected = forward(WanTransformer3DModel.from_pretrained(tmp_path), inputs)
    handle = offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, backend=chaos_backend(),
                                          host_memory=0)
    assert handle.stats()["disk_bytes"] == sum(u.nbytes for u in handle.parts[0].units)
    for _ in range(2):
        assert torch.equal(forward(handle.target, inputs), expected)
    handle.disable()
    assert torch.equal(forward(handle.target, inputs), expected)


def test_from_pretrained_leaves_other_weight_formats_to_diffusers(tmp_path):
    from diffusers import WanTransformer3DModel
    from denoisers import build_transformer

    model, inputs = build_transformer("wan-t2v")
    model.save_pretrained(tmp_path, safe_serialization=False)
    expected = forward(WanTransformer3DModel.from_pretrained(tmp_path), inputs)
    handle = offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, backend=chaos_backend())
    assert torch.equal(forward(handle.target, inputs), expected)
    handle.disable()


def test_from_pretrained_checks_its_input_before_loading(tmp_path):
    with pytest.raises(offload_core.OffloadConfigError, match="no strategy"):
        offload_core.from_pretrained(tmp_path)
    with pytest.raises(offload_core.OffloadConfigError, match="pinned_memory"):
        offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True, pinned_memory="lots")
    with pytest.raises(offload_core.OffloadConfigError, match="torch_dtype"):
        offload_core.from_pretrained(tmp_path, torch_dtype="bf16", enable_layerwise_offload=True)
    with pytest.raises(FileNotFoundError, match="model_index.json.*config.json"):
        offload_core.from_pretrained(tmp_path, enable_layerwise_offload=True)


# -- no second copy -----------------------------------------------------------------------------
def test_disable_releases_each_slab_before_unpacking_the_next(monkeypatch):
    """Homes share pinned slabs: a slab goes as soon as the last home in it is unpacked, so what
    disable still holds is exactly the slabs of the units not yet unpacked."""
    monkeypatch.setattr(slabs_module, "MIN_SLAB_BYTES", 2048)
    monkeypatch.setattr(slabs_module, "REQUESTS_PER_SLAB", 1)
    model = build_stack(StackSpec(d=16, layer_dtypes=[[torch.float32]] * 5))
    backend = chaos_backend()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    part = handle.parts[0]
    units = [part.resident, *part.units]  # the order disable unpacks them in
    slabs = [{b.untyped_storage().data_ptr(): b.untyped_storage().nbytes() for b in u.host.values()} for u in units]
    assert handle.placement.slabs.live_slabs >= 3
    pinned: list[int] = []
    unpack = WeightUnit.unpack
    monkeypatch.setattr(
        WeightUnit, "unpack", lambda self, *args: (unpack(self, *args), pinned.append(backend.pinned_memory_allocated()))
    )
    handle.disable()
    still_held = [{ptr: size for later in slabs[k + 1:] for ptr, size in later.items()} for k in range(len(units))]
    assert pinned == [sum(held.values()) for held in still_held]
    assert len(set(pinned)) >= 3 and pinned[-1] == 0


def _distributed_worker(rank: int, port: int) -> None:
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    torch.set_num_threads(1)
    from helpers import assert_same_state, chaos_backend, snapshot
    from offload_core.hostmem import staging
    from offload_core.weights.unit import WeightUnit

    staging.BOUNCE_CHUNK_BYTES = 64
    backend = chaos_backend()
    backend.init_process_group(rank, 2, f"tcp://127.0.0.1:{port}")
    model = mixed_stack()
    expected = [run(model, X + i) for i in range(3)]
    before = snapshot(model)
    padded: list = []  # every block's padded copy: only one may be alive at a time
    take = WeightUnit.take

    def tracked(self, allocate):
        assert not any(ref() is not None for ref in padded), "two blocks' padded copies alive at once"
        buffers = take(self, allocate)
        padded.extend(weakref.ref(b.untyped_storage()) for b in buffers.values())
        return buffers

    WeightUnit.take = tracked
    handle = offload_core.enable_offload(model, enable_distributed_layerwise_offload=True, backend=backend,
                                         pinned_memory=0)
    assert len(padded) >= len(handle.describe()[0]["streamed_blocks"])
    assert handle.stats()["pageable_host_bytes"] > 0
    for _ in range(2):
        for i in range(3):
            assert torch.equal(run(model, X + i), expected[i]), f"rank {rank} step {i}"
    handle.disable()
    assert_same_state(before, snapshot(model))


def test_distributed_enable_holds_one_padded_block_at_a_time_and_stages_shards():
    mp.spawn(_distributed_worker, args=(free_port(),), nprocs=2, join=True)


def test_the_pipeline_check_does_not_import_diffusers_pipelines():
    code = (
        "import sys, torch, offload_core\n"
        "h = offload_core.enable_offload(torch.nn.Sequential(torch.nn.Linear(2, 2)), enable_cpu_offload=True, "
        "backend='fake')\n"
        "h.disable()\n"
        "assert 'diffusers.pipelines' not in sys.modules, 'imported'\n"
    )
    import subprocess

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_loading_packing_and_spilling_show_progress_in_bytes(tmp_path, monkeypatch, small_chunks):
    import tqdm.auto
    from denoisers import build_transformer

    bars: list = []

    class Bar:
        def __init__(self, total=None, desc="", unit="it", **kwargs):
            self.total, self.unit, self.descs, self.done = total, unit, [desc], 0
            bars.append(self)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def set_description(self, desc):
            self.descs.append(desc)

        def update(self, n):
            self.done += n

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    model = mixed_stack()
    resident, blocks = unit_bytes(model)
    ring = staging.BOUNCE_BUFFERS * aligned(64)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend(),
                                         host_memory=resident + ring + blocks[0], offload_folder=tmp_path / "spill")
    handle.disable()
    (bar,) = bars
    assert bar.unit == "B" and bar.total == bar.done == resident + sum(blocks)
    assert {d.split()[0] for d in bar.descs[1:]} == {"packing", "spilling"}
    wan, _ = build_transformer("wan-t2v")
    wan.save_pretrained(tmp_path / "wan")
    bars.clear()
    offload_core.from_pretrained(tmp_path / "wan", enable_layerwise_offload=True, backend=chaos_backend()).disable()
    (bar,) = bars
    assert bar.unit == "B" and bar.total == bar.done > 0
    assert {d.split()[0] for d in bar.descs[1:]} == {"loading"}


# -- resident memory, measured -------------------------------------------------------------------
#: a Wan transformer of 8 blocks of 29 MB (bf16): big enough that RSS shows a second copy
MODERATE = dict(patch_size=(1, 2, 2), num_attention_heads=8, attention_head_dim=128, in_channels=16, out_channels=16,
                text_dim=1024, freq_dim=256, ffn_dim=3072, num_layers=8, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
MiB = 2**20


def test_host_peaks_stay_within_one_copy_of_the_model(tmp_path):
    """Each scenario in a fresh process (see offload_core/bench/hostmem.py): enable and disable of
    a built model, a second cycle, from_pretrained, and the disk tier with a quarter of the model
    in RAM. Allowances: one block, the 64 MiB between two trims of the C heap, the bounce ring."""
    from offload_core.bench.hostmem import run_scenario, write_checkpoint

    model = write_checkpoint(str(tmp_path), MODERATE)
    cycles = run_scenario("cycles", str(tmp_path), MODERATE, model)
    block, slack = cycles["block"], 64 * MiB
    # pinned homes share slabs: a slab is allocated before the units that fill it are packed, and
    # freed once the last of them is unpacked, so enable and disable may hold one slab more
    slab = max(slabs_module.MIN_SLAB_BYTES, slabs_module.REQUESTS_PER_SLAB * block)
    assert cycles["built"] <= model + 16 * MiB
    assert cycles["enable_1"] <= model + block + slab + slack
    assert cycles["disable_1"] <= model + block + slab + slack
    assert cycles["after_cycle_1"] <= cycles["built"] + 16 * MiB
    assert cycles["enable_2"] <= model + block + slab + slack
    assert cycles["after_cycle_2"] <= cycles["after_cycle_1"] + 16 * MiB
    load = run_scenario("from_pretrained", str(tmp_path), MODERATE, model)
    assert load["load"] <= model + 32 * MiB  # read straight into the homes: no second copy at all
    assert load["disable"] <= model + block + slab + slack
    disk = run_scenario("disk_quarter", str(tmp_path), MODERATE, model)
    assert disk["disk_bytes"] >= model // 2
    ring = disk["bounce_bytes"]
    assert max(disk["load"], disk["forward"]) <= model // 4 + ring + block + 16 * MiB


def test_from_pretrained_replaces_a_component_like_diffusers(tmp_path):
    """``text_encoder=None``: the pipeline loads without its encoder and runs on prompt embeddings
    computed elsewhere, the DiT's blocks read from the checkpoint (host_memory=0)."""
    import diffusers
    from offload_core.tiny import as_tensor, build_pipeline

    tiny = build_pipeline("flux2")
    tiny.pipe.save_pretrained(tmp_path)
    call = dict(tiny.call_kwargs)
    with torch.no_grad():
        embeds, _ = tiny.pipe.encode_prompt(prompt=call.pop("prompt"), device="cpu",
                                            max_sequence_length=call.pop("max_sequence_length"),
                                            text_encoder_out_layers=call.pop("text_encoder_out_layers"))
    reference = diffusers.Flux2Pipeline.from_pretrained(tmp_path, text_encoder=None)
    for tensor in reference.transformer.parameters():
        # weights read from the file may start anywhere (diffusers can map the file); kernels pick
        # their path by alignment, and offloaded weights start at aligned addresses: compare alike
        tensor.data = tensor.data.clone()
    reference.set_progress_bar_config(disable=True)
    expected = as_tensor(reference(prompt_embeds=embeds, generator=torch.Generator().manual_seed(0), **call).images)
    handle = offload_core.from_pretrained(tmp_path, text_encoder=None, enable_layerwise_offload=True,
                                          backend=chaos_backend(), host_memory=0)
    pipe = handle.target
    assert pipe.text_encoder is None and handle.stats()["disk_bytes"] > 0
    pipe.set_progress_bar_config(disable=True)
    got = as_tensor(pipe(prompt_embeds=embeds, generator=torch.Generator().manual_seed(0), **call).images)
    assert torch.equal(got, expected)
    handle.disable()
    with pytest.raises(offload_core.OffloadConfigError, match="not_a_component"):
        offload_core.from_pretrained(tmp_path, not_a_component=None, enable_layerwise_offload=True)
