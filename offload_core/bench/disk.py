"""Disk-tier benchmark: how fast blocks on disk reach the device, against the drive itself.

A Wan transformer checkpoint (random bf16 weights, see :func:`.hostmem.write_checkpoint`) is loaded
twice with ``offload_core.from_pretrained`` on the fake backend: once with every weight in RAM (the
compute figure: a forward that reads nothing from disk) and once with a ``host_memory`` budget of a
tenth of the model, so that nearly every block lives on disk and is read in every forward. Each
repetition runs, in an order that rotates from one repetition to the next, a buffered sequential
read of the checkpoint files (one request at a time through the page cache, as context), the
disk-bound forward, the in-RAM forward, and the tier measured alone between two of the drive's own
reads (:func:`direct_read`: ``O_DIRECT``, several requests in flight, the figure a drive is quoted
at; and :func:`reader_read`, the tier's reader alone, its requests as the tier makes them). Every
read and disk-bound forward starts with the files' pages evicted (``POSIX_FADV_DONTNEED``: exact
for clean pages of files no one maps, which these are; the whole page cache, which every other
process on the machine uses, is never dropped).

The tier alone is the disk-bound forward with every block's compute skipped
(:func:`compute_skipped`), which loads, binds and waits for each block as a forward does. On a
device the blocks compute there; on the fake backend they take the host's CPU, which on a small
busy machine the reads then wait for. The drive is read just before and just after it, and its
figure is the faster of the two: a virtual disk's speed drifts with what else runs, a drive read
minutes away from the tier's would judge the tier at another speed, and the best the drive showed
around the tier is the strictest baseline at hand.

Figures, each a median over the repetitions with its spread: the tier's throughput alone (the bytes
``handle.stats()`` counts in ``disk_read_bytes`` over that forward's seconds) over the drive's
around it (the faster of its two reads, each the fastest of :func:`drive_patterns` and
:func:`reader_read`; NaN, which the table calls unreliable, for ``--quick``'s few MB; above 1 by
more than its spread, the drive's figure is too weak a baseline), the whole forward's time over its ideal, max(in-RAM
forward, bytes read / the drive's speed) (below 1 by more than its spread: the same), and the CPU
time the tier spends per GB read (the process's CPU time in the disk-bound forward above the in-RAM
forward's, over the bytes read), with the share of those bytes a reader copied into place from its
scratch buffer (``tier_scratch_share``: the rest the drive wrote straight into the bounce buffers).
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import logging
import mmap
import os
import resource
import tempfile
import threading
import time
from typing import Any, Callable

from ..hostmem import hugepages
from .hostmem import GB, QUICK, WAN_1_3B, _inputs, write_checkpoint

logger = logging.getLogger(__name__)

#: the buffered read's request size
_READ_BYTES = 16 * 2**20
#: the drive's read: requests in flight and their size
DIRECT_THREADS = 8
DIRECT_REQUEST_BYTES = 4 * 2**20


def drive_patterns() -> list[tuple[int, int]]:
    """The (requests in flight, request bytes) the benchmark reads the drive with beside the tier's
    own reader (:func:`reader_read`), its figure the fastest each time: a virtual disk's best depth
    and request size differ from a physical drive's."""
    return [(DIRECT_THREADS, DIRECT_REQUEST_BYTES), (16, 8 * 2**20)]


def _checkpoint_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def cold_cache(files: list[str]) -> None:
    """Evict ``files``' pages from the page cache (written back first, so that they are clean)."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def cpu_seconds() -> float:
    """The process's CPU time so far, every thread's and the kernel's work for them."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def sequential_read(files: list[str]) -> tuple[int, float]:
    """(bytes, seconds) of reading ``files`` front to back through the page cache, one 16 MiB
    request at a time."""
    buffer = memoryview(bytearray(_READ_BYTES))
    total, start = 0, time.perf_counter()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buffer]):
                total += n
        finally:
            os.close(fd)
    return total, time.perf_counter() - start


def direct_method(threads: int = DIRECT_THREADS, request: int = DIRECT_REQUEST_BYTES) -> str:
    return (f"O_DIRECT, {threads} threads each with one {request // 2**20} MiB os.preadv in flight into a "
            "page-aligned buffer on huge pages (io_uring has no binding in Python's standard library)")


def direct_read(files: list[str], threads: int = DIRECT_THREADS, request: int = DIRECT_REQUEST_BYTES
                ) -> tuple[int, float]:
    """(bytes, seconds) of reading ``files`` as the drive reads best: ``O_DIRECT`` (no page cache,
    the drive's DMA straight into this process's buffers), ``threads`` requests of ``request``
    bytes in flight, each into a page-aligned buffer of its own. Raises ``OSError`` where the
    file system refuses ``O_DIRECT``."""
    pieces = [(path, offset) for path in files for offset in range(0, os.path.getsize(path), request)]
    fds = {path: os.open(path, os.O_RDONLY | os.O_DIRECT) for path in files}
    lock, done, failures = threading.Lock(), [0], []
    pending = iter(pieces)

    def reader() -> None:
        buffer, start = hugepages.mapping(request)  # aligned, as O_DIRECT needs, on huge pages as the tier's
        view = memoryview(buffer)[start : start + request]
        try:
            while True:
                with lock:
                    piece = next(pending, None)
                if piece is None:
                    return
                n = os.preadv(fds[piece[0]], [view], piece[1])  # the file's tail: fewer bytes
                with lock:
                    done[0] += n
        except OSError as exc:
            failures.append(exc)
        finally:
            view.release()
            buffer.close()

    workers = [threading.Thread(target=reader, name=f"offload-core-bench-read-{k}") for k in range(threads)]
    start = time.perf_counter()
    try:
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    finally:
        for fd in fds.values():
            os.close(fd)
    if failures:
        raise failures[0]
    return done[0], time.perf_counter() - start


def reader_method() -> str:
    from ..hostmem import direct, staging

    return (f"the tier's own reader (O_DIRECT, {direct.READERS} reader threads with one "
            f"{direct.PIECE_BYTES // 2**20} MiB piece each in flight, {staging.BOUNCE_BUFFERS} chunks of "
            f"{staging.BOUNCE_CHUNK_BYTES // 2**20} MiB queued, nothing copied or computed)")


def reader_read(files: list[str]) -> tuple[int, float]:
    """(bytes, seconds) of reading ``files`` with the tier's own reader (``hostmem.direct``) as
    the bounce ring queues it (a chunk's reads in each of its buffers, page-aligned), with nothing
    copied out or computed: what the drive gives the tier's requests, without the tier."""
    from ..hostmem import direct, staging

    ahead, chunk = staging.BOUNCE_BUFFERS, staging.BOUNCE_CHUNK_BYTES
    buffers: list[mmap.mmap] = []
    views: list = []
    fds: dict[str, int] = {}
    pending: collections.deque = collections.deque()
    try:
        for _ in range(ahead):
            buffer, start = hugepages.mapping(chunk)
            buffers.append(buffer)
            views.append((ctypes.c_char * chunk).from_buffer(buffer, start))
        for path in files:
            fds[path] = os.open(path, os.O_RDONLY | os.O_DIRECT)
        chunks = [(fds[path], offset, min(chunk, size - offset))
                  for path in files for size in [os.path.getsize(path)] for offset in range(0, size, chunk)]
        start = time.perf_counter()
        for k, (fd, offset, nbytes) in enumerate(chunks):
            if len(pending) == ahead:
                pending.popleft()()
            pending.append(direct.submit([(fd, offset, ctypes.addressof(views[k % ahead]), nbytes)]))
        while pending:
            pending.popleft()()
        seconds = time.perf_counter() - start
    finally:
        for landed in pending:  # none may still write a buffer about to be unmapped
            with contextlib.suppress(BaseException):
                landed()
        for fd in fds.values():
            os.close(fd)
        views.clear()  # the mappings close only once nothing exports them
        for buffer in buffers:
            buffer.close()
    return sum(n for _, _, n in chunks), seconds


def drive_read_bandwidth(folder: str | None = None, nbytes: int = 256 * 2**20) -> float:
    """Bytes per second the drive under ``folder`` (default: the temporary folder) reads: a file of
    ``nbytes`` written there, evicted from the page cache and read back as :func:`direct_read`
    reads (buffered, one request at a time, where the file system refuses ``O_DIRECT``), then
    removed. What ``offload-core plan --disk-bandwidth measure`` plans the disk tier with."""
    with tempfile.NamedTemporaryFile(dir=folder, prefix="offload-core-drive-", suffix=".bin") as file:
        chunk = os.urandom(16 * 2**20)  # random: a compressing file system would read less
        for _ in range(max(1, nbytes // len(chunk))):
            file.write(chunk)
        file.flush()
        cold_cache([file.name])
        try:
            read, seconds = direct_read([file.name])
        except OSError:
            read, seconds = sequential_read([file.name])
    return read / seconds


@contextlib.contextmanager
def compute_skipped(blocks):
    """Every one of ``blocks`` hands its first input on unchanged: the offloaded model's forward
    still loads each block into its slot, binds it and waits for it, but computes nothing there.
    On a device the blocks' compute leaves the host's CPU to the reads; on the fake backend it
    takes it, so the tier is measured with it taken out."""
    saved = [(block, block.__dict__.get("forward")) for block in blocks]
    for block in blocks:
        block.forward = _passthrough
    try:
        yield
    finally:
        for block, forward in saved:
            if forward is None:
                del block.forward
            else:
                block.forward = forward


def _passthrough(hidden_states, *args, **kwargs):
    return hidden_states


def _interleave(variants: list[Callable[[], None]], repeats: int, on_disk, in_ram, inputs) -> None:
    """A warm-up forward of each model (first-pass measurements, the allocator), then the
    variants, their order rotating from one repetition to the next."""
    import torch

    with torch.no_grad():
        on_disk.target(**inputs)
        in_ram.target(**inputs)
        for rep in range(repeats):
            for variant in variants[rep % len(variants):] + variants[: rep % len(variants)]:
                variant()


def disk_tier(quick: bool = False, repeats: int = 3) -> dict[str, Any]:
    import torch

    import offload_core
    from offload_core.hostmem import direct

    from .timing import ratio, spread

    config = QUICK if quick else WAN_1_3B
    with tempfile.TemporaryDirectory(prefix="offload-core-bench-disk-") as folder:
        model_bytes = write_checkpoint(folder, config)
        files = _checkpoint_files(folder)
        backend = offload_core.get_backend("fake", chaos=False, sanitize=False)
        load = lambda **options: offload_core.from_pretrained(  # noqa: E731
            folder, torch_dtype=torch.bfloat16, enable_layerwise_offload=True, backend=backend, **options)
        in_ram = load()
        on_disk = load(host_memory=model_bytes // 10)
        inputs = _inputs(config)
        samples: dict[str, list[float]] = {name: [] for name in (
            "raw_s", "raw_bytes", "buffered_s", "buffered_bytes", "tier_s", "tier_bytes", "tier_read_s", "tier_cpu_s",
            "tier_scratch_bytes", "alone_s", "alone_bytes", "compute_s", "compute_cpu_s")}

        raw_method = ["the fastest each time of " + ", of ".join(direct_method(*p) for p in drive_patterns())
                      + " and of " + reader_method()]

        def drive() -> tuple[int, float]:
            reads = []
            for read in [*(functools.partial(direct_read, threads=t, request=r) for t, r in drive_patterns()),
                         reader_read]:
                cold_cache(files)
                try:
                    reads.append(read(files))
                except OSError as exc:  # a file system without O_DIRECT (tmpfs): a weaker baseline, named so
                    raw_method[0] = f"buffered, one request at a time: O_DIRECT refused ({exc})"
                    return sequential_read(files)
            return min(reads, key=lambda read: read[1])

        def buffered() -> None:
            cold_cache(files)
            n, seconds = sequential_read(files)
            samples["buffered_bytes"].append(n)
            samples["buffered_s"].append(seconds)

        def tier() -> None:
            cold_cache(files)
            before, scratch = on_disk.stats(), direct.scratch_bytes
            cpu, start = cpu_seconds(), time.perf_counter()
            on_disk.target(**inputs)
            samples["tier_s"].append(time.perf_counter() - start)
            samples["tier_cpu_s"].append(cpu_seconds() - cpu)
            samples["tier_scratch_bytes"].append(direct.scratch_bytes - scratch)
            after = on_disk.stats()
            samples["tier_bytes"].append(after["disk_read_bytes"] - before["disk_read_bytes"])
            samples["tier_read_s"].append(after["disk_read_seconds"] - before["disk_read_seconds"])

        def alone() -> None:
            """The tier alone between two reads of the drive: the drive's figure is the faster of
            them, so that a drive whose speed drifts (a virtual disk, other work) is judged at the
            tier's time, at its best."""
            before_n, before_s = drive()
            cold_cache(files)
            before = on_disk.stats()["disk_read_bytes"]
            with compute_skipped(on_disk.target.blocks):
                start = time.perf_counter()
                on_disk.target(**inputs)
                samples["alone_s"].append(time.perf_counter() - start)
            samples["alone_bytes"].append(on_disk.stats()["disk_read_bytes"] - before)
            after_n, after_s = drive()
            faster_n, faster_s = max((before_n, before_s), (after_n, after_s), key=lambda read: read[0] / read[1])
            samples["raw_bytes"].append(faster_n)
            samples["raw_s"].append(faster_s)

        def compute() -> None:
            cpu, start = cpu_seconds(), time.perf_counter()
            in_ram.target(**inputs)
            samples["compute_s"].append(time.perf_counter() - start)
            samples["compute_cpu_s"].append(cpu_seconds() - cpu)

        variants: list[Callable[[], None]] = [alone, tier, buffered, compute]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # compute takes one core, as a device would: the host's threads get the rest
        try:
            _interleave(variants, repeats, on_disk, in_ram, inputs)
        finally:
            torch.set_num_threads(threads)
        stats = on_disk.stats()
        on_disk.disable()
        in_ram.disable()
    raw_speed = [b / s for b, s in zip(samples["raw_bytes"], samples["raw_s"])]
    buffered_speed = [b / s for b, s in zip(samples["buffered_bytes"], samples["buffered_s"])]
    tier_speed = [b / s for b, s in zip(samples["tier_bytes"], samples["tier_s"])]
    alone_speed = [b / s for b, s in zip(samples["alone_bytes"], samples["alone_s"])]
    ideal = [max(c, b / r) for c, b, r in zip(samples["compute_s"], samples["tier_bytes"], raw_speed)]
    tier_cpu = [(t - c) / (b / GB) for t, c, b in zip(samples["tier_cpu_s"], samples["compute_cpu_s"],
                                                      samples["tier_bytes"])]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    # reported beside the ideal: whether the whole forward's ideal is the drive's read or its compute
    disk_bound = median(samples["compute_s"]) < median([b / r for b, r in zip(samples["tier_bytes"], raw_speed)])
    # the quick model's few MB say nothing of a drive either
    tier_over_raw, tier_over_raw_spread = ratio(alone_speed, raw_speed) if not quick else (float("nan"),) * 2
    over_ideal, over_ideal_spread = ratio(samples["tier_s"], ideal)
    return {
        "model": "Wan2.1-1.3B transformer, bf16" if not quick else "small Wan transformer, bf16",
        "model_bytes": model_bytes,
        "disk_bytes": stats["disk_bytes"],
        "cold_cache": "fadvise_dontneed",
        "raw_method": raw_method[0],
        "buffered_method": f"one {_READ_BYTES // 2**20} MiB readv at a time through the page cache",
        "repeats": repeats,
        "raw_mb_s": median(raw_speed) / 1e6,
        "buffered_mb_s": median(buffered_speed) / 1e6,
        "tier_mb_s": median(alone_speed) / 1e6,
        "forward_mb_s": median(tier_speed) / 1e6,
        "disk_bound": disk_bound,
        "tier_over_raw": tier_over_raw,
        "tier_cpu_s_per_gb": median(tier_cpu),
        # of the bytes read, those copied into place from a reader's scratch buffer (the rest the
        # drive wrote straight into the bounce buffers)
        "tier_scratch_share": median([c / b for c, b in zip(samples["tier_scratch_bytes"], samples["tier_bytes"])]),
        "compute_s": median(samples["compute_s"]),
        "forward_s": median(samples["tier_s"]),
        "forward_over_ideal": over_ideal,
        # the stager's time in reads over the forward's: near 1, the forward waits for the drive
        "read_wait_share": median([r / s for r, s in zip(samples["tier_read_s"], samples["tier_s"])]),
        "bytes_read_per_forward_gb": median(samples["tier_bytes"]) / GB,
        "samples": samples,
        "spread": {"tier_over_raw": tier_over_raw_spread, "forward_over_ideal": over_ideal_spread,
                   "raw_mb_s": spread(raw_speed) / 1e6, "tier_cpu_s_per_gb": spread(tier_cpu)},
    }
