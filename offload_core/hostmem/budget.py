"""Host-memory budgets: what the user may write for ``pinned_memory=`` / ``host_memory=``, what the
machine has, and handing freed memory back to the operating system.

A budget is bytes (an ``int``), a string with a unit (``"12GiB"``, ``"512MB"``), a fraction of
physical RAM (a ``float`` in (0, 1]), or ``None`` / ``"auto"`` for the documented default. Parsing
happens when the options are validated, so a typo fails before anything is touched; fractions are
turned into bytes when a placement is planned, against the RAM of the machine that runs it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import re

logger = logging.getLogger(__name__)

#: "auto" pinned budget: at most this share of physical RAM is page-locked, by all of this
#: backend's pinned allocations together. Page-locked memory cannot be swapped or reclaimed, and
#: drivers refuse (or the kernel stalls) well before all of RAM is pinned.
AUTO_PINNED_SHARE = 0.5
#: "auto" host budget of ``from_pretrained``: the share of the memory available when loading
#: starts that weights may take; the rest of the blocks stream from the checkpoint.
AUTO_HOST_SHARE = 0.9

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*$")


class Budget:
    """A parsed budget: ``nbytes`` or ``fraction`` of RAM, or neither for "auto"."""

    __slots__ = ("nbytes", "fraction")

    def __init__(self, nbytes: int | None = None, fraction: float | None = None) -> None:
        self.nbytes = nbytes
        self.fraction = fraction

    @property
    def auto(self) -> bool:
        return self.nbytes is None and self.fraction is None

    def resolve(self) -> int | None:
        """Bytes, or None for "auto" (the caller applies its own default)."""
        if self.nbytes is not None:
            return self.nbytes
        if self.fraction is not None:
            return int(self.fraction * physical_memory())
        return None

    def __repr__(self) -> str:
        if self.auto:
            return "Budget(auto)"
        return f"Budget({self.nbytes} bytes)" if self.nbytes is not None else f"Budget({self.fraction:g} of RAM)"


def budget(value: object) -> object:
    """The option parser of a budget: ``value`` itself, once :func:`parse_budget` accepts it."""
    parse_budget(value)
    return value


def parse_budget(value: object) -> Budget:
    """``value`` as a :class:`Budget`; ``ValueError`` saying what is accepted."""
    accepted = ("expected bytes (an int >= 0), a size string such as '12GiB' or '512MB', "
                "a fraction of RAM in (0, 1] such as 0.5, or None / 'auto'")
    if value is None or (isinstance(value, str) and value.strip().lower() == "auto"):
        return Budget()
    if isinstance(value, bool):
        raise ValueError(f"{accepted}; got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{accepted}; got {value!r}")
        return Budget(nbytes=value)
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"{accepted}; got {value!r} (a float is a fraction of RAM; give bytes as an int)")
        return Budget(fraction=value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ValueError(f"{accepted}; got {value!r}")
        return Budget(nbytes=int(float(match.group(1)) * _UNITS[unit]))
    raise ValueError(f"{accepted}; got {type(value).__name__} {value!r}")


def physical_memory() -> int:
    """Bytes of physical RAM."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """Bytes of RAM the kernel could give this process now without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


@functools.lru_cache(maxsize=1)
def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        return libc.malloc_trim
    except (OSError, AttributeError, TypeError):  # not glibc (musl, macOS): nothing to trim
        return None


def return_free_memory() -> None:
    """Give memory that the C allocator keeps after large frees back to the operating system.

    glibc raises its mmap threshold after large blocks are freed, so later large buffers come
    from the heap and, once freed, stay in the process: without a trim a second enable/disable
    cycle would start from the first one's peak."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class Trimmer:
    """Returns freed memory to the OS after every ``every`` bytes of weights moved.

    Packing frees each original tensor as its copy is made, and unpacking frees each home as its
    tensors get their own storage again. Tensors below glibc's mmap threshold live on the heap,
    where freed memory is reused only by allocations that fit in the holes; without a trim along
    the way the process would hold the old copy and the new one at once."""

    def __init__(self, every: int = 64 * 2**20) -> None:
        self.every = every
        self._moved = 0

    def add(self, nbytes: int) -> None:
        self._moved += nbytes
        if self._moved >= self.every:
            self.flush()

    def flush(self) -> None:
        """Trim now if more than a few MiB moved since the last trim (a trim costs milliseconds)."""
        if self._moved >= self.every // 16:
            return_free_memory()
        self._moved = 0
