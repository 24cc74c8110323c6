"""The disk tier: blocks beyond ``host_memory`` are read from their checkpoint in every forward,
past the page cache with several requests in flight where the file system allows it; else
through it, the blocks that run next asked of the kernel ahead of the stager (wrapping to the
first block for the next step) within a bounded window; the bytes read counted in
``handle.stats()``."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from safetensors import safe_open

import offload_core
from offload_core.hostmem import direct, disk, staging
from offload_core.weights.owners import collect_tensors
from offload_core.weights.placeholders import check_placeholders, placeholders
from offload_core.weights.unit import WeightUnit

from helpers import chaos_backend, forward

pytestmark = pytest.mark.fake_only


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Wan DiT of four blocks saved as diffusers saves one, and its output without
    offloading (more blocks than slots: read-ahead reaches past what the slots hold)."""
    from diffusers import WanTransformer3DModel
    from denoisers import build_transformer

    folder = tmp_path_factory.mktemp("wan")
    small, inputs = build_transformer("wan-t2v")
    torch.manual_seed(0)
    model = WanTransformer3DModel.from_config({**small.config, "num_layers": 4})
    model.save_pretrained(folder)
    expected = forward(WanTransformer3DModel.from_pretrained(folder), inputs)
    return folder, inputs, expected


@pytest.fixture
def page_cache_reads(monkeypatch):
    """Files read through the page cache, as on a file system without O_DIRECT: the read-ahead's path."""
    monkeypatch.setattr(direct, "ENABLED", False)


def block_bytes_in_checkpoint(folder) -> int:
    """What the checkpoint holds for the streamed blocks, read with safetensors itself."""
    with safe_open(str(next(folder.glob("*.safetensors"))), framework="pt") as f:
        return sum(f.get_tensor(key).nbytes for key in f.keys() if key.startswith("blocks."))


def on_disk(folder, **options):
    return offload_core.from_pretrained(folder, enable_layerwise_offload=True, backend=chaos_backend(),
                                        host_memory=0, **options)


def test_disk_read_stats_count_exactly_the_bytes_of_the_disk_blocks_per_forward(checkpoint, kib_chunks):
    folder, inputs, expected = checkpoint
    handle = on_disk(folder)
    per_forward = block_bytes_in_checkpoint(folder)
    assert per_forward > 0
    last = handle.stats()
    for _ in range(2):
        assert torch.equal(forward(handle.target, inputs), expected)
        now = handle.stats()
        assert now["disk_read_bytes"] - last["disk_read_bytes"] == per_forward
        assert now["disk_read_seconds"] > last["disk_read_seconds"]
        last = now
    handle.disable()


class Recorder:
    """What the drive is asked for and read, in the order it happens across threads: the
    read-ahead's requests (``ask``, per block) and the stager's reads (``read``, per chunk), each
    read slowed down so that the order does not depend on how the threads happen to be scheduled."""

    def __init__(self, monkeypatch, handle) -> None:
        self.events: list[tuple[str, int]] = []
        self.lock = threading.Lock()
        index = {id(record.image): record.index for record in handle.parts[0].records}
        advise, submit = disk.DiskImage.advise, disk.DiskImage.submit

        def asked(image):
            self.add("ask", index[id(image)])
            advise(image)

        def slow_read(image, *args):
            time.sleep(0.01)
            read, landed = submit(image, *args)
            landed()
            self.add("read", index[id(image)])
            return read, lambda: None

        monkeypatch.setattr(disk.DiskImage, "advise", asked)
        monkeypatch.setattr(disk.DiskImage, "submit", slow_read)

    def add(self, kind: str, block: int) -> None:
        with self.lock:
            self.events.append((kind, block))


def test_the_next_blocks_are_asked_for_before_the_current_one_is_read_wrapping_to_the_first(
        checkpoint, kib_chunks, page_cache_reads, monkeypatch):
    folder, inputs, expected = checkpoint
    handle = on_disk(folder)
    part = handle.describe()[0]
    blocks, slots = len(part["streamed_blocks"]), part["slots"]
    assert blocks > slots
    record = Recorder(monkeypatch, handle)
    with handle.frozen():
        for _ in range(2):
            assert torch.equal(forward(handle.target, inputs), expected)
    events = list(record.events)  # not disable's reads of the homes
    handle.disable()

    def first_pass_reads(i: int) -> list[int]:
        """Where block i's chunks are read in the first forward: one run of reads."""
        start = events.index(("read", i))
        run = [k for k in range(start, len(events)) if events[k] == ("read", i)]
        other = next((k for k in range(start, len(events)) if events[k][0] == "read" and events[k][1] != i),
                     len(events))
        return [k for k in run if k < other]

    for i in range(blocks):
        last_read = first_pass_reads(i)[-1]
        for ahead in range(1, slots + 1):  # as far as the slots reach, and one block beyond them
            following = (i + ahead) % blocks  # past the last block: the first ones, for the next step
            wrapped = following < i
            since = first_pass_reads(following)[0] if wrapped else -1
            asked = [k for k, e in enumerate(events) if e == ("ask", following) and k > since]
            assert asked and asked[0] < last_read, (i, following, events)
    # each block is asked for once per pass: the second pass asks again for what the first read
    for i in range(blocks):
        assert events.count(("ask", i)) >= 2, (i, events)


def test_read_ahead_stays_within_its_window(checkpoint, kib_chunks, page_cache_reads, monkeypatch):
    """No more than the configured read-ahead is asked for beyond the block being staged (but
    always the next block), and the output is exact."""
    folder, inputs, expected = checkpoint
    handle = on_disk(folder)
    sizes = [record.image.file_bytes for record in handle.parts[0].records]
    handle.disable()
    window = max(sizes) + 1  # one block ahead at a time
    monkeypatch.setattr(staging, "READ_AHEAD_BYTES", window)
    handle = on_disk(folder)
    read_ahead = handle.placement.read_ahead
    assert read_ahead.window == window
    for _ in range(2):
        assert torch.equal(forward(handle.target, inputs), expected)
    assert max(sizes) <= read_ahead.peak_bytes <= window < sum(sizes)
    handle.disable()


def test_read_ahead_covers_every_file_byte_of_each_block_in_requests_the_kernel_reads_whole(
        checkpoint, kib_chunks, page_cache_reads, monkeypatch):
    """Linux reads only the first max(read_ahead_kb, max_sectors_kb) of a larger WILLNEED range:
    the read-ahead asks in pieces of at most that (here set to one page), and together they hold
    every byte the blocks read."""
    folder, inputs, expected = checkpoint
    monkeypatch.setattr(disk.DataFile, "advise_bytes", 4096)
    asked: list[tuple[int, int]] = []
    fadvise = disk.os.posix_fadvise

    def recorded(fd, offset, length, advice):
        if advice == disk.os.POSIX_FADV_WILLNEED:
            asked.append((offset, length))
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(disk.os, "posix_fadvise", recorded)
    handle = on_disk(folder)
    assert torch.equal(forward(handle.target, inputs), expected)
    images = [record.image for record in handle.parts[0].records]
    handle.disable()  # the read-ahead has made every request
    assert asked and max(length for _, length in asked) <= 4096
    covered = set()
    for offset, length in asked:
        covered.update(range(offset, offset + length))
    for image in images:
        for segments in image.segments.values():
            for _, _, piece in segments:
                if isinstance(piece, disk.FileSlice):
                    assert covered.issuperset(range(piece.offset, piece.offset + piece.nbytes))


def test_disk_blocks_are_read_past_the_page_cache_in_pieces_in_flight_together(checkpoint, kib_chunks, monkeypatch):
    """Where the file system allows O_DIRECT: every file byte of a block comes through
    ``direct.submit`` (a chunk's slices in one call), nothing is asked of the kernel's read-ahead
    (it would read the same bytes a second time), and the output is exact."""
    folder, inputs, expected = checkpoint
    handle = on_disk(folder)
    if not direct.usable(handle.parts[0].records[0].image.extents()[0][0]):
        handle.disable()
        pytest.skip("this file system refuses O_DIRECT")
    calls: list[int] = []
    willneed: list[int] = []
    submit, fadvise = direct.submit, disk.os.posix_fadvise

    def counted(jobs):
        calls.append(sum(nbytes for _, _, _, nbytes in jobs))
        return submit(jobs)

    def recorded(fd, offset, length, advice):
        if advice == disk.os.POSIX_FADV_WILLNEED:
            willneed.append(length)
        fadvise(fd, offset, length, advice)

    monkeypatch.setattr(direct, "submit", counted)
    monkeypatch.setattr(disk.os, "posix_fadvise", recorded)
    before = handle.stats()["disk_read_bytes"]
    assert torch.equal(forward(handle.target, inputs), expected)
    assert sum(calls) == handle.stats()["disk_read_bytes"] - before == block_bytes_in_checkpoint(folder)
    assert len(calls) > len(handle.describe()[0]["streamed_blocks"]) and not willneed
    handle.disable()


def test_the_ring_keeps_the_next_chunks_reads_in_flight_while_one_is_copied(checkpoint, kib_chunks, monkeypatch):
    """A block of several chunks: the ring queues a chunk's reads in every bounce buffer whose last
    copy has run (as many as it has buffers), waits for every one of them, and the output is exact."""
    folder, inputs, expected = checkpoint
    handle = on_disk(folder)
    buffers = len(handle.parts[0].placement.ring.buffers)
    submit, lock = disk.DiskImage.submit, threading.Lock()
    outstanding, most = [0], [0]

    def counted(image, *args):
        read, landed = submit(image, *args)
        with lock:
            outstanding[0] += 1
            most[0] = max(most[0], outstanding[0])

        def waited():
            landed()
            with lock:
                outstanding[0] -= 1

        return read, waited

    monkeypatch.setattr(disk.DiskImage, "submit", counted)
    assert torch.equal(forward(handle.target, inputs), expected)
    handle.disable()
    assert most[0] == buffers > 1 and outstanding[0] == 0


def test_a_blocks_dtypes_are_read_as_one_sequence(checkpoint, kib_chunks, monkeypatch):
    """A block whose weights come in two dtypes (bf16, and the float32 modules diffusers keeps in
    float32): the next dtype's first reads are queued while the last ones of the dtype before are
    still in flight, so the small dtype costs no round trip to the drive of its own; exact."""
    from diffusers import WanTransformer3DModel

    folder, inputs, _ = checkpoint
    inputs = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v
              for k, v in inputs.items()}
    reference = forward(WanTransformer3DModel.from_pretrained(folder, torch_dtype=torch.bfloat16), inputs)
    handle = on_disk(folder, torch_dtype=torch.bfloat16)
    submit, lock = disk.DiskImage.submit, threading.Lock()
    in_flight: list[torch.dtype] = []
    together = [0]

    def counted(image, dtype, *args):
        read, landed = submit(image, dtype, *args)
        with lock:
            in_flight.append(dtype)
            together[0] = max(together[0], len(set(in_flight)))

        def waited():
            landed()
            with lock:
                in_flight.remove(dtype)

        return read, waited

    monkeypatch.setattr(disk.DiskImage, "submit", counted)
    assert {len(record.image.segments) for record in handle.parts[0].records} == {2}  # bf16 and float32
    assert torch.equal(forward(handle.target, inputs), reference)
    handle.disable()
    assert together[0] == 2 and in_flight == []


def test_a_direct_read_lands_every_byte_whatever_its_alignment(tmp_path, monkeypatch):
    """Pieces at odd offsets and lengths, larger than a reader's scratch, several in flight:
    byte for byte what a plain read gives; a file shorter than a job needs fails clearly."""
    monkeypatch.setattr(direct, "PIECE_BYTES", 3 * direct.ALIGN)
    path = tmp_path / "blob"
    data = torch.randint(0, 256, (200_003,), dtype=torch.uint8)
    path.write_bytes(data.numpy().tobytes())
    file = disk.DataFile(path)
    if not direct.usable(file):
        pytest.skip("this file system refuses O_DIRECT")
    with direct.reading(file) as fd:
        spans = [(1, 5), (4095, 4098), (12_289, 50_000), (100_000, 100_003), (0, 4096)]
        outs = [torch.zeros(n, dtype=torch.uint8) for _, n in spans]
        direct.read([(fd, offset, out.data_ptr(), n) for (offset, n), out in zip(spans, outs)])
        for (offset, n), out in zip(spans, outs):
            assert torch.equal(out, data[offset : offset + n]), (offset, n)
        with pytest.raises(EOFError, match="short of a tensor"):
            direct.read([(fd, 199_000, outs[2].data_ptr(), 5_000)])
    file.close()


def test_placeholders_hold_the_poison_of_their_dtype_and_refuse_every_in_place_operator():
    """Each dtype's poison (NaN, the integer maximum, True) in every placeholder; the in-place
    operators torch does not name after an in-place method (``|=``, ``<<=``, ``[i] =``) are refused
    as ``mul_`` is, and a write around the refusal is undone by ``check_placeholders``."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.ones(4))
    module.register_buffer("count", torch.zeros(4, dtype=torch.int64))
    module.register_buffer("mask", torch.zeros(4, dtype=torch.bool))
    unit = WeightUnit("m", collect_tensors([module]))
    views = placeholders(unit)
    unit.bind(views)
    assert isinstance(module.weight, torch.nn.Parameter) and module.weight.isnan().all()
    assert (module.count == torch.iinfo(torch.int64).max).all() and module.mask.all()
    for write in ("__ior__", "__iand__", "__ixor__", "__ilshift__", "__irshift__", "__setitem__"):
        with pytest.raises(offload_core.OffloadedModelError, match="nowhere to go"):
            getattr(module.count, write)(*((0, 1) if write == "__setitem__" else (1,)))
    with pytest.raises(offload_core.OffloadedModelError, match="nowhere to go"):
        module.mask.logical_not_()
    module.count.detach().zero_()
    with pytest.raises(offload_core.OffloadedModelError, match="block m has no home in RAM.*the write was undone"):
        check_placeholders(views, "block m")
    assert (module.count == torch.iinfo(torch.int64).max).all()
    check_placeholders(views, "block m")  # the poison back: nothing to undo
