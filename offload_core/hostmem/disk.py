"""Weights on disk: safetensors checkpoints and spill files, read with positional reads.

Reads use ``os.preadv``, never ``mmap``: mapped file pages count in the process's resident memory
for as long as the mapping lives. Where the file system allows it, the slices a read needs are
read past the page cache, several at once (:mod:`.direct`). Elsewhere they are read straight into
the destination's memory (a bounce buffer or a packed home) through the page cache, which the
kernel reclaims freely. Descriptors come from process-wide caches of a few (:mod:`.descriptors`).
A checkpoint's header is checked before any of its tensors is used (:mod:`.safetensors_header`).
What a unit's image asks the kernel to read ahead (:meth:`DiskImage.advise`), for files read
through the page cache, is its file bytes merged into page-aligned extents, asked for in pieces
the kernel reads whole: Linux quietly reads only the first ``max(read_ahead_kb, max_sectors_kb)``
of a larger ``POSIX_FADV_WILLNEED`` range, so one request per tensor (or per block) leaves most of
a large block to be read when the stager gets to it, one request at a time.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Iterable

import torch

from ..base.errors import CheckpointError
from ..weights.slices import ALIGN, DIRECT_MIN_BYTES, FileSlice
from . import direct
from .descriptors import DESCRIPTORS
from .safetensors_header import DTYPES, read_header

_PAGE = 4096  # read-ahead extents start and end on page boundaries
_EXTENT_GAP = 2**20  # file slices closer than this are read ahead as one extent (the gap comes along)
_DEFAULT_ADVISE_BYTES = 128 * 1024  # Linux's default read-ahead: where a file's device says nothing


class DataFile:
    """A file weights are read from (a checkpoint, a spill file); its descriptor is opened when
    it is read, from the process's cache (:mod:`.descriptors`), and closed by :meth:`close`, or
    when the file object dies."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)

    def reading(self) -> contextlib.AbstractContextManager[int]:
        """An open descriptor for the reads inside the block."""
        return DESCRIPTORS.reading(self)

    def close(self) -> None:
        """Close the descriptors now (or when the reads using them end); a later read opens them again."""
        DESCRIPTORS.close(self)
        direct.DESCRIPTORS.close(self)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit the cache may be gone first
            self.close()

    @functools.cached_property
    def advise_bytes(self) -> int:
        """The most one read-ahead request of this file reads: Linux caps ``POSIX_FADV_WILLNEED``
        at the larger of its device's read-ahead and largest request (``max(read_ahead_kb,
        max_sectors_kb)``, 8 MiB on a typical NVMe drive), whatever range it is given."""
        dev = os.stat(self.path).st_dev
        base = f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}"
        for queue in (f"{base}/queue", f"{base}/../queue"):  # a disk's, or a partition's disk's
            try:
                with open(f"{queue}/read_ahead_kb", encoding="ascii") as ra, \
                        open(f"{queue}/max_sectors_kb", encoding="ascii") as io:
                    return max(int(ra.read()), int(io.read()), 4) * 1024
            except (OSError, ValueError):
                continue
        return _DEFAULT_ADVISE_BYTES


def checkpoint_slices(path: str | os.PathLike) -> dict[str, FileSlice]:
    """The tensors of one safetensors checkpoint file by name, its header checked first (see
    :mod:`.safetensors_header`). The file's descriptor lives as long as its slices (they alone
    hold the file: no cycle keeps it open after them)."""
    header = read_header(os.fspath(path))
    file = DataFile(path)
    slices = {}
    for name, entry in header.tensors.items():
        dtype = DTYPES.get(entry.code)
        if dtype is None:
            raise CheckpointError(f"{file.path}: tensor {name!r} has dtype {entry.code}, which offload-core "
                                  "cannot read (no torch dtype holds it one element at a time)")
        slices[name] = FileSlice(file, header.data_start + entry.begin, dtype, entry.shape)
    return slices


class MemorySlice:
    """A small region kept in memory inside an otherwise on-disk unit (a buffer that no file
    holds, such as a non-persistent rotary table)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def read(self, start: int, count: int, out: torch.Tensor) -> int:
        out.copy_(self.tensor[start : start + count])
        return 0  # nothing from disk


class DiskImage:
    """Where each element range of a unit's per-dtype home lies: file slices (and small memory
    slices). Ranges between regions (alignment gaps) are never read, so they hold nothing."""

    def __init__(self) -> None:
        self.segments: dict[torch.dtype, list[tuple[int, int, object]]] = {}  # (start, count, slice)
        self._extents: list[tuple[DataFile, int, int]] | None = None
        self._file_bytes = 0
        self._residues: dict[torch.dtype, int | None] = {}

    def add(self, dtype: torch.dtype, start: int, count: int, source) -> None:
        self.segments.setdefault(dtype, []).append((start, count, source))
        self._extents = None
        self._residues.pop(dtype, None)

    def residue(self, dtype: torch.dtype) -> int | None:
        """Where the ``dtype`` home's large file slices lie in their files relative to their place
        in the home, modulo a page (:data:`ALIGN`): the value most of their bytes share, None where
        it is no whole number of elements or there are none. The bounce ring lays the home out at
        that offset within a page, so that those slices are read straight into place."""
        if dtype not in self._residues:
            weight: dict[int, int] = {}
            for start, count, source in self.segments.get(dtype, ()):
                if isinstance(source, FileSlice) and source.dtype == dtype and source.nbytes >= DIRECT_MIN_BYTES:
                    delta = (source.offset - start * dtype.itemsize) % ALIGN
                    weight[delta] = weight.get(delta, 0) + count
            best = max(weight, key=weight.__getitem__, default=None)
            self._residues[dtype] = best if best is not None and best % dtype.itemsize == 0 else None
        return self._residues[dtype]

    def read(self, dtype: torch.dtype, start: int, count: int, out: torch.Tensor) -> int:
        """Elements ``start .. start + count`` of the ``dtype`` home into ``out``; returns the
        bytes read from files (what ``disk_read_bytes`` counts)."""
        read, landed = self.submit(dtype, start, count, out)
        landed()
        return read

    def submit(self, dtype: torch.dtype, start: int, count: int,
               out: torch.Tensor) -> tuple[int, Callable[[], None]]:
        """:meth:`read`, returning once its reads are queued: (the bytes it reads from files, a
        function that returns once they have landed in ``out``). File slices of ``out``'s dtype in
        files that allow it are read past the page cache, all of them in flight together
        (:func:`.direct.submit`); the rest one by one, before this returns."""
        end, read, jobs = start + count, 0, []
        held = contextlib.ExitStack()
        try:
            fds: dict[DataFile, int] = {}
            for seg_start, seg_count, source in self.segments.get(dtype, ()):
                lo, hi = max(start, seg_start), min(end, seg_start + seg_count)
                if lo >= hi:
                    continue
                part = out[lo - start : hi - start]
                if not (isinstance(source, FileSlice) and source.dtype == out.dtype and direct.usable(source.file)):
                    read += source.read(lo - seg_start, hi - lo, part)
                    continue
                if source.file not in fds:
                    fds[source.file] = held.enter_context(direct.reading(source.file))
                offset = source.offset + (lo - seg_start) * source.dtype.itemsize
                jobs.append((fds[source.file], offset, part.data_ptr(), part.nbytes))
                read += part.nbytes
            reads = direct.submit(jobs) if jobs else None
        except BaseException:
            held.close()
            raise

        def landed() -> None:
            with held:  # the descriptors stay open until every read of them has landed
                if reads is not None:
                    reads()

        return read, landed

    @property
    def file_bytes(self) -> int:
        """The bytes a full read of this image takes from files."""
        self.extents()
        return self._file_bytes

    def files(self) -> set[DataFile]:
        """The files this image reads."""
        return {s.file for segments in self.segments.values() for _, _, s in segments if isinstance(s, FileSlice)}

    def extents(self) -> list[tuple[DataFile, int, int]]:
        """(file, offset, length): this image's file bytes as page-aligned extents in file order,
        slices less than ``_EXTENT_GAP`` apart merged."""
        if self._extents is None:
            spans = sorted(((s.file, s.offset, s.offset + s.nbytes) for segments in self.segments.values()
                            for _, _, s in segments if isinstance(s, FileSlice) and s.nbytes),
                           key=lambda span: (span[0].path, span[1]))
            self._file_bytes = sum(end - begin for _, begin, end in spans)
            merged: list[list] = []
            for file, begin, end in spans:
                begin, end = begin - begin % _PAGE, -(-end // _PAGE) * _PAGE
                if merged and merged[-1][0] is file and begin <= merged[-1][2] + _EXTENT_GAP:
                    merged[-1][2] = max(merged[-1][2], end)
                else:
                    merged.append([file, begin, end])
            self._extents = [(file, begin, end - begin) for file, begin, end in merged]
        return self._extents

    def advise(self) -> None:
        """Ask the kernel to read this image's extents into its page cache, in requests no larger
        than it honours whole (:attr:`DataFile.advise_bytes`): each returns once its reads are
        queued, and they fill the cache, not this process's resident memory."""
        for file, offset, length in self.extents():
            if direct.usable(file):  # read past the page cache: caching it would read it twice
                continue
            try:
                step = file.advise_bytes
                with file.reading() as fd:
                    for begin in range(offset, offset + length, step):
                        os.posix_fadvise(fd, begin, min(step, offset + length - begin), os.POSIX_FADV_WILLNEED)
            except (AttributeError, OSError):  # not offered on this platform, or the file is gone: reads start cold
                return


def checkpoint_image(unit) -> DiskImage:
    """The image of a unit read from a checkpoint: its regions' slices (converted to the home's
    dtype as they are read, where it differs), and the few regions no file holds (buffers
    computed at construction) kept in memory."""
    return image_of(unit, lambda r: MemorySlice(r.source.as_strided((r.numel,), (1,), r.first)),
                    lambda r: r.reader is not None)


def in_checkpoint(region) -> bool:
    """A region read from its checkpoint slice in the slice's own dtype (not narrowed on the way:
    ``storage_dtype=``)."""
    return region.reader is not None and getattr(region.reader, "dtype", region.dtype) == region.dtype


def image_of(unit, fallback, from_reader: Callable = in_checkpoint) -> DiskImage:
    """A unit's image: each region ``from_reader`` accepts read from its checkpoint slice, the
    others from ``fallback(region)``."""
    image = DiskImage()
    for r in unit.regions:
        if r.numel:
            image.add(r.dtype, r.start, r.numel, r.reader if from_reader(r) else fallback(r))
    return image


def read_index(files: Iterable[str | os.PathLike]) -> dict[str, FileSlice]:
    """Every tensor of ``files`` by name, each file's header checked; a name in two files is
    refused (which one a loader would use is arbitrary)."""
    slices: dict[str, FileSlice] = {}
    for path in files:
        for name, found in checkpoint_slices(path).items():
            if name in slices:
                raise CheckpointError(f"tensor {name!r} is in both {slices[name].file.path} and {found.file.path}")
            slices[name] = found
    return slices
