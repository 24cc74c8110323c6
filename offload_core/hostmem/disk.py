"""Weights on disk: safetensors files read with positional reads, and units spilled to a folder.

Reads use ``os.preadv`` straight into the destination's memory (a bounce buffer or a packed
home), never ``mmap``: mapped file pages count in the process's resident memory for as long as
the mapping lives, positional reads only fill the kernel's page cache, which it reclaims freely.
What a unit's image asks the kernel to read ahead (:meth:`DiskImage.advise`) is its file bytes
merged into page-aligned extents, asked for in pieces the kernel reads whole: Linux quietly
reads only the first ``max(read_ahead_kb, max_sectors_kb)`` of a larger ``POSIX_FADV_WILLNEED``
range, so one request per tensor (or per block) leaves most of a large block to be read when
the stager gets to it, one request at a time.
"""

from __future__ import annotations

import atexit
import functools
import json
import logging
import os
import shutil
import struct
import tempfile
import threading
from typing import Callable, Iterable

import torch


logger = logging.getLogger(__name__)

#: safetensors dtype codes
DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
}
CODES = {dtype: code for code, dtype in DTYPES.items()}
_HEADER_ALIGN = 64
_PAGE = 4096  # read-ahead extents start and end on page boundaries
_EXTENT_GAP = 2**20  # file slices closer than this are read ahead as one extent (the gap comes along)
_DEFAULT_ADVISE_BYTES = 128 * 1024  # Linux's default read-ahead: where a file's device says nothing


def _as_bytes(t: torch.Tensor) -> memoryview:
    """The memory of a flat contiguous tensor as a writable byte buffer."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def pread_into(fd: int, out: torch.Tensor, offset: int) -> None:
    """Fill ``out`` (flat, contiguous) with the bytes of ``fd`` at ``offset``."""
    if out.numel() == 0:
        return
    view = _as_bytes(out)
    while view:
        n = os.preadv(fd, [view], offset)
        if n <= 0:
            raise EOFError(f"file ends {len(view)} bytes short of a tensor at offset {offset}")
        view = view[n:]
        offset += n


class SafetensorsFile:
    """One safetensors file: its tensor table, and a descriptor opened on first read."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        with open(self.path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        self.data_start = 8 + length
        header.pop("__metadata__", None)
        self.tensors: dict[str, FileSlice] = {}
        for name, info in header.items():
            dtype = DTYPES.get(info["dtype"])
            if dtype is None:
                raise ValueError(f"{self.path}: tensor {name} has dtype {info['dtype']}, which offload-core cannot read")
            begin, end = info["data_offsets"]
            numel = 1
            for s in info["shape"]:
                numel *= s
            if (end - begin) != numel * dtype.itemsize:
                raise ValueError(f"{self.path}: tensor {name} has {end - begin} bytes for shape {info['shape']}")
            self.tensors[name] = FileSlice(self, self.data_start + begin, dtype, tuple(info["shape"]))
        self._fd: int | None = None
        self._lock = threading.Lock()

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

    def fd(self) -> int:
        if self._fd is None:
            with self._lock:
                if self._fd is None:
                    self._fd = os.open(self.path, os.O_RDONLY)
        return self._fd

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)


class FileSlice:
    """A tensor stored in a file; reads any element range, converting to the reader's dtype."""

    __slots__ = ("file", "offset", "dtype", "shape")

    def __init__(self, file: SafetensorsFile, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.file = file
        self.offset = offset  # absolute byte offset of the first element
        self.dtype = dtype
        self.shape = shape

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def read(self, start: int, count: int, out: torch.Tensor) -> int:
        """Elements ``start .. start + count`` into ``out`` (flat); one read, plus a conversion
        through a buffer of this slice's size when the dtypes differ. Returns the bytes read."""
        where = self.offset + start * self.dtype.itemsize
        if out.dtype == self.dtype:
            pread_into(self.file.fd(), out, where)
        else:
            raw = torch.empty(count, dtype=self.dtype)
            pread_into(self.file.fd(), raw, where)
            out.copy_(raw)
        return count * self.dtype.itemsize


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
        self._extents: list[tuple[SafetensorsFile, int, int]] | None = None
        self._file_bytes = 0

    def add(self, dtype: torch.dtype, start: int, count: int, source) -> None:
        self.segments.setdefault(dtype, []).append((start, count, source))
        self._extents = None

    def read(self, dtype: torch.dtype, start: int, count: int, out: torch.Tensor) -> int:
        """Elements ``start .. start + count`` of the ``dtype`` home into ``out``; returns the
        bytes read from files (what ``disk_read_bytes`` counts)."""
        end, read = start + count, 0
        for seg_start, seg_count, source in self.segments.get(dtype, ()):
            lo, hi = max(start, seg_start), min(end, seg_start + seg_count)
            if lo < hi:
                read += source.read(lo - seg_start, hi - lo, out[lo - start : hi - start])
        return read

    @property
    def file_bytes(self) -> int:
        """The bytes a full read of this image takes from files."""
        self.extents()
        return self._file_bytes

    def extents(self) -> list[tuple["SafetensorsFile", int, int]]:
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
        than it honours whole (:attr:`SafetensorsFile.advise_bytes`): each returns once its reads
        are queued, and they fill the cache, not this process's resident memory."""
        for file, offset, length in self.extents():
            step = file.advise_bytes
            for begin in range(offset, offset + length, step):
                try:
                    os.posix_fadvise(file.fd(), begin, min(step, offset + length - begin), os.POSIX_FADV_WILLNEED)
                except (AttributeError, OSError):  # not offered on this platform: reads just start cold
                    return


class SpillFolder:
    """A private folder, inside the one the user named, holding one safetensors file per spilled
    unit; removed with everything in it when offloading ends, or when the process exits without
    ``disable()`` (it may hold gigabytes, under a name nobody would look for), and logged where it
    is when it is made."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)
        self.path: str | None = None
        self._count = 0
        self._at_exit: Callable[[], None] | None = None  # holds the path, not this folder

    def write(self, unit) -> DiskImage:
        """Write ``unit``'s home image (one tensor per dtype, regions at their offsets) straight
        from its source tensors, and return where each region now lies. Regions read from a
        checkpoint in their own dtype are not rewritten: the image points at the checkpoint; one
        stored narrower than its checkpoint (``storage_dtype=``) is written as stored, converted
        region by region, so that the disk tier reads the narrow bytes."""
        if self.path is None:
            os.makedirs(self.root, exist_ok=True)
            self.path = tempfile.mkdtemp(prefix="offload-core-", dir=self.root)
            self._at_exit = functools.partial(shutil.rmtree, self.path, ignore_errors=True)
            atexit.register(self._at_exit)
            logger.info("spilling blocks to %s (removed by disable() or when the process exits)", self.path)
        self._count += 1
        path = os.path.join(self.path, f"{self._count:05d}-{unit.name}.safetensors")
        written = [r for r in unit.regions if not _in_checkpoint(r) and r.numel]
        dtypes = sorted({r.dtype for r in written}, key=lambda d: (-d.itemsize, str(d)))
        header, offset = {}, 0
        for dtype in dtypes:
            size = unit.numel[dtype] * dtype.itemsize
            header[str(dtype).removeprefix("torch.")] = {"dtype": CODES[dtype], "shape": [unit.numel[dtype]],
                                                        "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps(header).encode()
        text += b" " * (-(8 + len(text)) % _HEADER_ALIGN)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            _pwrite(fd, memoryview(struct.pack("<Q", len(text)) + text), 0)
            data = 8 + len(text)
            for r in written:
                base = data + header[str(r.dtype).removeprefix("torch.")]["data_offsets"][0]
                if r.reader is None:
                    span = r.source.as_strided((r.numel,), (1,), r.first)
                else:  # a checkpoint slice of another dtype, converted as it is read
                    span = torch.empty(r.numel, dtype=r.dtype)
                    r.reader.read(0, r.numel, span)
                _pwrite(fd, _as_bytes(span), base + r.start * r.dtype.itemsize)
            os.ftruncate(fd, data + offset)
        finally:
            os.close(fd)
        file = SafetensorsFile(path)

        def written(r) -> FileSlice:
            whole = file.tensors[str(r.dtype).removeprefix("torch.")]
            return FileSlice(file, whole.offset + r.start * r.dtype.itemsize, r.dtype, (r.numel,))

        return _image(unit, written, _in_checkpoint)

    def remove(self) -> None:
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            atexit.unregister(self._at_exit)
            self.path = self._at_exit = None


def checkpoint_image(unit) -> DiskImage:
    """The image of a unit read from a checkpoint: its regions' slices (converted to the home's
    dtype as they are read, where it differs), and the few regions no file holds (buffers
    computed at construction) kept in memory."""
    return _image(unit, lambda r: MemorySlice(r.source.as_strided((r.numel,), (1,), r.first)),
                  lambda r: r.reader is not None)


def _in_checkpoint(region) -> bool:
    """A region read from its checkpoint slice in the slice's own dtype."""
    return region.reader is not None and getattr(region.reader, "dtype", region.dtype) == region.dtype


def _image(unit, fallback, from_reader: Callable) -> DiskImage:
    """A unit's image: each region ``from_reader`` accepts read from its checkpoint slice, the
    others from ``fallback(region)``."""
    image = DiskImage()
    for r in unit.regions:
        if r.numel:
            image.add(r.dtype, r.start, r.numel, r.reader if from_reader(r) else fallback(r))
    return image


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def read_index(files: Iterable[str | os.PathLike]) -> dict[str, FileSlice]:
    """Every tensor of ``files`` by name."""
    slices: dict[str, FileSlice] = {}
    for path in files:
        slices.update(SafetensorsFile(path).tensors)
    return slices
