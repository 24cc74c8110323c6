"""Spill files: the blocks of a model already in memory that ``host_memory`` leaves out of RAM,
written to a private folder inside ``offload_folder`` and read from there when they run.

One safetensors file per block, holding its home's per-dtype buffers back to back, each stored
as a ``U8`` tensor of its bytes named after its dtype (``__metadata__`` maps each name to the torch
dtype): any dtype a tensor can have is written as it is (complex, float8, unsigned, bool), the
file is valid for any safetensors reader, and offload-core, which knows where it wrote what, never
parses it back.

A spill folder may hold gigabytes under a name nobody would look for, so it never outlives its
use. ``disable()`` and a failed enable remove it (a file written half way when the disk fills is
removed first), closing the descriptors of its files before the files go so that their space is
given back at once. A process that ends without ``disable()`` removes the spill folders it made:
at interpreter exit (``atexit``), and on SIGTERM and SIGHUP, whose default action ends a process
without running ``atexit``, through a handler installed when the first folder is made (from the
main thread, where Python allows it). That handler removes the folders, restores the default
action and raises the signal again, so the process still ends by it. Where a handler was
installed from Python before, it is called instead, and decides: if it ends the process (say,
``sys.exit``), ``atexit`` removes the folders; if it keeps the process running (a server that
finishes its requests first), the folders stay, since the model still reads them. A signal that
was ignored stays ignored and a handler installed outside Python is left alone. A forked child
never removes its parent's folders.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import struct
import tempfile
import threading

import torch

from ..weights.slices import FileSlice, as_bytes
from .disk import DataFile, DiskImage, image_of, in_checkpoint

logger = logging.getLogger(__name__)

_HEADER_ALIGN = 64  # the data section starts 64-byte aligned, as safetensors' own writer aligns it

#: the spill folders alive, each with the process that made it (a forked child inherits the table)
_live: dict[str, int] = {}
#: the signals whose default action would end the process without ``atexit``
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
#: the handler each signal had before this module's (installed once per process, never again:
#: a handler installed after it that chains to it would otherwise be chained to in a circle)
_previous: dict[int, object] = {}
_removed_at_exit = False
_signals_watched = False


class SpillFolder:
    """A private folder, inside the one the user named, holding one file per spilled unit;
    logged where it is when it is made."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = os.fspath(root)
        self.path: str | None = None
        self._count = 0
        self._files: list[DataFile] = []

    def write(self, unit) -> DiskImage:
        """Write ``unit``'s home image (its per-dtype buffers back to back, regions at their
        offsets) straight from its source tensors, and return where each region now lies.
        Regions read from a checkpoint in their own dtype are not rewritten: the image points at the
        checkpoint; one stored narrower than its checkpoint (``storage_dtype=``) is written as
        stored, converted as it is read, so that the disk tier reads the narrow bytes."""
        if self.path is None:
            self._make()
        self._count += 1
        path = os.path.join(self.path, f"{self._count:05d}-{unit.name}.safetensors")
        written = [r for r in unit.regions if not in_checkpoint(r) and r.numel]
        header, base, size = _header(unit, {r.dtype for r in written})
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _pwrite(fd, memoryview(header), 0)
            for r in written:
                if r.reader is None:
                    span = r.source.as_strided((r.numel,), (1,), r.first)
                else:  # a checkpoint slice of another dtype, narrowed region by region
                    span = torch.empty(r.numel, dtype=r.dtype)
                    r.reader.read(0, r.numel, span)
                _pwrite(fd, as_bytes(span), base[r.dtype] + r.start * r.dtype.itemsize)
            os.ftruncate(fd, size)
        except BaseException:  # a full disk, Ctrl-C: what was written goes at once
            os.close(fd)
            _unlink(path)
            raise
        os.close(fd)
        file = DataFile(path)
        self._files.append(file)
        return image_of(unit, lambda r: FileSlice(file, base[r.dtype] + r.start * r.dtype.itemsize, r.dtype,
                                                  (r.numel,)))

    def _make(self) -> None:
        os.makedirs(self.root, exist_ok=True)
        self.path = tempfile.mkdtemp(prefix="offload-core-", dir=self.root)
        _live[self.path] = os.getpid()
        _watch()
        logger.info("spilling blocks to %s (removed by disable() or when the process exits)", self.path)

    def remove(self) -> None:
        """Close the descriptors of the spill files, then remove the folder with everything in it."""
        for file in self._files:
            file.close()
        self._files.clear()
        if self.path is not None:
            shutil.rmtree(self.path, ignore_errors=True)
            if os.path.exists(self.path):
                logger.warning("could not remove the spill folder %s", self.path)
            _live.pop(self.path, None)
            self.path = None


def _header(unit, dtypes: set[torch.dtype]) -> tuple[bytes, dict[torch.dtype, int], int]:
    """The safetensors header of ``unit``'s spill file holding its ``dtypes`` buffers, where each
    buffer starts in the file, and the file's size."""
    table, metadata, offsets, data = {}, {}, [], 0
    for dtype in sorted(dtypes, key=lambda d: (-d.itemsize, str(d))):
        name = str(dtype).removeprefix("torch.")
        nbytes = unit.numel[dtype] * dtype.itemsize
        table[name] = {"dtype": "U8", "shape": [nbytes], "data_offsets": [data, data + nbytes]}
        metadata[name] = str(dtype)
        offsets.append((dtype, data))
        data += nbytes
    text = json.dumps({"__metadata__": metadata, **table}).encode()
    text += b" " * (-(8 + len(text)) % _HEADER_ALIGN)
    start = 8 + len(text)
    return struct.pack("<Q", len(text)) + text, {dtype: start + at for dtype, at in offsets}, start + data


def _pwrite(fd: int, view: memoryview, offset: int) -> None:
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def remove_all() -> None:
    """Remove every spill folder this process made and has not removed yet."""
    pid = os.getpid()
    for path, owner in list(_live.items()):
        if owner == pid:
            shutil.rmtree(path, ignore_errors=True)
            _live.pop(path, None)


def _watch() -> None:
    """Make sure this process's spill folders go when it ends (see the module docstring)."""
    global _removed_at_exit, _signals_watched
    if not _removed_at_exit:
        _removed_at_exit = True
        atexit.register(remove_all)
    if _signals_watched:
        return
    if threading.current_thread() is not threading.main_thread():
        logger.debug("spill folder made outside the main thread: removed at exit, but not on SIGTERM or SIGHUP "
                     "until one is made from the main thread")
        return
    _signals_watched = True
    for signum in _SIGNALS:
        previous = signal.getsignal(signum)
        if previous is signal.SIG_IGN or previous is None:  # ignored, or a handler set outside Python
            continue
        _previous[signum] = previous
        signal.signal(signum, _on_signal)


def _on_signal(signum: int, frame) -> None:
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):  # the program's own handler decides whether the process ends
        previous(signum, frame)
        return
    remove_all()
    signal.signal(signum, signal.SIG_DFL)
    signal.raise_signal(signum)
