"""Disk-tier benchmark: how fast blocks on disk reach the device, against the drive itself.

A Wan transformer checkpoint (random bf16 weights, see :func:`.hostmem.write_checkpoint`) is
loaded twice with ``offload_core.from_pretrained`` on the fake backend: once with every weight
in RAM (the compute figure: a forward that reads nothing from disk) and once with a
``host_memory`` budget of a tenth of the model, so that nearly every block lives on disk and is
read in every forward. Each repetition runs, in an order that rotates from one repetition to
the next, a plain sequential read of the checkpoint files and the disk-bound forward, each with
a cold page cache, and the in-RAM forward. The page cache is dropped through
``/proc/sys/vm/drop_caches`` where this process may write it (root) and ``--quick`` is not
given; otherwise the checkpoint's own pages are evicted with ``POSIX_FADV_DONTNEED`` (exact for
clean pages of files no one maps, which these are). The result says which.

Figures, each a median over the repetitions with its spread: the tier's throughput (the bytes
``handle.stats()`` counts in ``disk_read_bytes`` over the forward's seconds) over the plain
read's (NaN, which the table calls unreliable, when the forward waited for its compute more
than for the drive, as ``--quick``'s small model does), and the forward's time over its ideal,
max(in-RAM forward, bytes read / plain read speed).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time
from typing import Any, Callable

from .hostmem import GB, QUICK, WAN_1_3B, _inputs, write_checkpoint

logger = logging.getLogger(__name__)

_READ_BYTES = 16 * 2**20  # the plain read's request size


def _checkpoint_files(folder: str) -> list[str]:
    return sorted(os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".safetensors"))


def cold_cache(files: list[str], system: bool) -> str:
    """Empty the page cache of ``files``: the whole cache when ``system`` and this process may,
    else the files' own pages. Returns the method used."""
    os.sync()
    if system:
        try:
            with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
                f.write("3")
            return "drop_caches"
        except OSError:
            pass
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise_dontneed"


def sequential_read(files: list[str]) -> tuple[int, float]:
    """(bytes, seconds) of reading ``files`` front to back in large requests, one at a time."""
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
        samples: dict[str, list[float]] = {"raw_s": [], "raw_bytes": [], "tier_s": [], "tier_bytes": [],
                                           "tier_read_s": [], "compute_s": []}
        methods = set()

        def raw() -> None:
            methods.add(cold_cache(files, system=not quick))
            n, seconds = sequential_read(files)
            samples["raw_bytes"].append(n)
            samples["raw_s"].append(seconds)

        def tier() -> None:
            methods.add(cold_cache(files, system=not quick))
            before = on_disk.stats()
            start = time.perf_counter()
            on_disk.target(**inputs)
            samples["tier_s"].append(time.perf_counter() - start)
            after = on_disk.stats()
            samples["tier_bytes"].append(after["disk_read_bytes"] - before["disk_read_bytes"])
            samples["tier_read_s"].append(after["disk_read_seconds"] - before["disk_read_seconds"])

        def compute() -> None:
            start = time.perf_counter()
            in_ram.target(**inputs)
            samples["compute_s"].append(time.perf_counter() - start)

        variants: list[Callable[[], None]] = [raw, tier, compute]
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # compute takes one core, as a device would: the host's threads get the rest
        try:
            _interleave(variants, repeats, on_disk, in_ram, inputs)
        finally:
            torch.set_num_threads(threads)
        read_ahead = on_disk.placement.read_ahead
        peak_ahead = read_ahead.peak_bytes if read_ahead is not None else 0
        stats = on_disk.stats()
        on_disk.disable()
        in_ram.disable()
    raw_speed = [b / s for b, s in zip(samples["raw_bytes"], samples["raw_s"])]
    tier_speed = [b / s for b, s in zip(samples["tier_bytes"], samples["tier_s"])]
    ideal = [max(c, b / r) for c, b, r in zip(samples["compute_s"], samples["tier_bytes"], raw_speed)]
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    # a forward that waits for its compute more than for the drive says nothing of the drive
    disk_bound = median(samples["compute_s"]) < median([b / r for b, r in zip(samples["tier_bytes"], raw_speed)])
    tier_over_raw, tier_over_raw_spread = ratio(tier_speed, raw_speed) if disk_bound else (float("nan"),) * 2
    over_ideal, over_ideal_spread = ratio(samples["tier_s"], ideal)
    return {
        "model": "Wan2.1-1.3B transformer, bf16" if not quick else "small Wan transformer, bf16",
        "model_bytes": model_bytes,
        "disk_bytes": stats["disk_bytes"],
        "cold_cache": " + ".join(sorted(methods)),
        "repeats": repeats,
        "raw_mb_s": median(raw_speed) / 1e6,
        "tier_mb_s": median(tier_speed) / 1e6,
        "disk_bound": disk_bound,
        "tier_over_raw": tier_over_raw,
        "compute_s": median(samples["compute_s"]),
        "forward_s": median(samples["tier_s"]),
        "forward_over_ideal": over_ideal,
        # the stager's time in reads over the forward's: near 1, the forward waits for the drive
        "read_wait_share": median([r / s for r, s in zip(samples["tier_read_s"], samples["tier_s"])]),
        "bytes_read_per_forward_gb": median(samples["tier_bytes"]) / GB,
        "read_ahead_peak_bytes": peak_ahead,
        "samples": samples,
        "spread": {"tier_over_raw": tier_over_raw_spread, "forward_over_ideal": over_ideal_spread,
                   "raw_mb_s": spread(raw_speed) / 1e6},
    }
