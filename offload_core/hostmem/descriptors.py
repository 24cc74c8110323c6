"""The descriptors of checkpoint and spill files: few open at once, closed when their file goes.

A model on disk may be hundreds of files (a spill file per block, a checkpoint's shards): one
descriptor kept open per file runs into ``RLIMIT_NOFILE`` (often 1024, 256 on some systems), and
a descriptor of a deleted file keeps its disk space taken. So a file is opened when it is read
and its descriptor kept in a process-wide cache of at most :data:`OPEN_FILES` (the least recently
used one closed to make room), which spares reopening a file for each chunk of a block, a cost on
network file systems. A descriptor in use by a read (the stager, the read-ahead thread, a load)
is never closed under it: it is closed when that read ends, once its file is closed or evicted.
A forked child starts with an empty cache of its own.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import weakref
from typing import Iterator

from ..base.locks import locked

#: the most checkpoint and spill file descriptors open at once (more only while that many reads
#: hold theirs: one per reading thread)
OPEN_FILES = 32


class _Descriptor:
    __slots__ = ("fd", "file", "users", "dropped")

    def __init__(self, fd: int, file) -> None:
        self.fd = fd
        self.file = weakref.ref(file)  # keyed by id: a dead file's id may be reused
        self.users = 0
        self.dropped = False  # closed when the last user is done


class DescriptorCache:
    """Open descriptors by file (any object with a ``path``), least recently used first."""

    def __init__(self, limit: int = OPEN_FILES, flags: int = 0) -> None:
        self.limit = limit
        self.flags = flags  # opened with these too (``O_DIRECT``: the reads past the page cache)
        self._open: collections.OrderedDict[int, _Descriptor] = collections.OrderedDict()
        # re-entrant: a file's finalizer (``close``) may run inside a cache operation of this
        # thread; taken through ``locks.locked``, so that no interrupt leaves it held
        self._lock = threading.RLock()

    @contextlib.contextmanager
    def reading(self, file) -> Iterator[int]:
        """A descriptor of ``file`` open for reading until the block ends."""
        d = locked(self._lock, self._use, file)
        try:
            yield d.fd
        finally:
            locked(self._lock, self._done, d)

    def _use(self, file) -> _Descriptor:
        d = self._open.get(id(file))
        if d is not None and d.file() is not file:  # left by a file that died unclosed
            del self._open[id(file)]
            self._drop(d)
            d = None
        if d is None:
            self._make_room()
            d = _Descriptor(os.open(file.path, os.O_RDONLY | os.O_CLOEXEC | self.flags), file)
            self._open[id(file)] = d
        else:
            self._open.move_to_end(id(file))
        d.users += 1
        return d

    @staticmethod
    def _done(d: _Descriptor) -> None:
        d.users -= 1
        if d.dropped and d.users == 0:
            os.close(d.fd)

    def close(self, file) -> None:
        """Close ``file``'s descriptor now, or when the reads using it end; a later read opens it
        again."""
        locked(self._lock, self._close, file)

    def _close(self, file) -> None:
        d = self._open.pop(id(file), None)
        if d is not None:
            self._drop(d)

    def open_count(self) -> int:
        """Descriptors this cache holds open (those of evicted files still in use included)."""
        return locked(self._lock, len, self._open)

    def _after_fork(self) -> None:
        """In a forked child: the parent's threads, and their reads, are gone; the descriptors
        (copies of the parent's) are closed and the lock made anew (a parent thread may have held
        it at the fork)."""
        self._lock = threading.RLock()
        for d in self._open.values():
            with contextlib.suppress(OSError):
                os.close(d.fd)
        self._open.clear()

    def _make_room(self) -> None:
        for key, d in list(self._open.items()):
            if len(self._open) < self.limit:
                return
            if d.users == 0:
                del self._open[key]
                self._drop(d)

    @staticmethod
    def _drop(d: _Descriptor) -> None:
        d.dropped = True
        if d.users == 0:
            os.close(d.fd)


#: the process's cache: the bound holds across every handle and checkpoint
DESCRIPTORS = DescriptorCache()
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=DESCRIPTORS._after_fork)
