"""The machine's host memory as this process may use it: what it has, the shares of it the "auto"
budgets take, and handing freed memory back to the operating system.

"The machine" is the smaller of the host and the memory cgroup the process runs in: inside a
container with a memory limit, the host's RAM and ``MemAvailable`` over-commit, and the kernel
kills the process when its cgroup reaches the limit. So RAM here is ``min(MemTotal, limit)`` and
available memory ``min(MemAvailable, limit - usage)``, over every cgroup level from the process's
own up to the root of the hierarchy it can see (a parent's lower limit applies to its children),
on cgroup v2 (``memory.max``, ``memory.current``) and v1 (``memory.limit_in_bytes``,
``memory.usage_in_bytes``). Usage leaves out the page cache the kernel reclaims before it kills
anything (``inactive_file`` of ``memory.stat``), as container runtimes count it.

What the user may write for ``pinned_memory=`` / ``host_memory=`` is parsed with the other options
(:class:`offload_core.common.config.Budget`); a fraction of RAM is turned into bytes here, when a
placement is decided, against the RAM of the machine that runs it.

Tests point every read at a fake tree: :envvar:`OFFLOAD_CORE_SYSTEM_ROOT` (or ``root=``) names a
folder read in place of ``/`` (its ``proc/meminfo``, ``proc/self/cgroup``,
``proc/self/mountinfo`` and the cgroup folders the mount table names).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import functools
import logging
import os

logger = logging.getLogger(__name__)

#: "auto" pinned budget: at most this share of physical RAM is page-locked, by all of this
#: backend's pinned allocations together. Page-locked memory cannot be swapped or reclaimed, and
#: drivers refuse (or the kernel stalls) well before all of RAM is pinned.
AUTO_PINNED_SHARE = 0.5
#: "auto" host budget of ``from_pretrained``: the share of the memory available when loading
#: starts that weights may take; the rest of the blocks stream from the checkpoint.
AUTO_HOST_SHARE = 0.9
#: names a folder read in place of ``/`` for the files this module reads (tests)
SYSTEM_ROOT_ENV = "OFFLOAD_CORE_SYSTEM_ROOT"
#: a cgroup v1 limit at or above this is "no limit" (the kernel writes 2^63 rounded down to a page)
_UNLIMITED_V1 = 2**62


@dataclasses.dataclass(frozen=True)
class CgroupLevel:
    """One level of the process's memory cgroup that has a limit."""

    path: str  # the cgroup's folder
    limit: int
    usage: int  # bytes charged, less the reclaimable page cache

    @property
    def headroom(self) -> int:
        return max(self.limit - self.usage, 0)


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """RAM and available memory as this process may use them, and where each figure comes from."""

    ram: int
    available: int
    ram_limit: CgroupLevel | None  # the cgroup whose limit is below the host's RAM, if one is
    available_limit: CgroupLevel | None  # the cgroup whose headroom is below MemAvailable, if one is

    def ram_source(self) -> str:
        if self.ram_limit is None:
            return f"physical RAM {size_text(self.ram)}"
        return f"the cgroup limit {size_text(self.ram)} ({self.ram_limit.path})"

    def available_source(self) -> str:
        if self.available_limit is None:
            return f"MemAvailable {size_text(self.available)}"
        level = self.available_limit
        return (f"the cgroup limit {size_text(level.limit)} less its usage {size_text(level.usage)} ({level.path})")


def size_text(n: int) -> str:
    """``n`` bytes in the largest binary unit it reaches, for messages."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def _root(root: str | os.PathLike | None) -> str:
    return os.fspath(root) if root is not None else os.environ.get(SYSTEM_ROOT_ENV) or "/"


def _under(root: str, path: str) -> str:
    return os.path.join(root, path.lstrip("/"))


def _meminfo(root: str) -> dict[str, int]:
    found = {}
    try:
        with open(_under(root, "/proc/meminfo"), encoding="ascii") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    found[name] = int(fields[0]) * 1024
    except OSError:
        pass
    return found


def _read_int(path: str) -> int | None:
    """The number in a cgroup file; None when absent, unreadable or "max" (no limit)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: str, name: str) -> int:
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == name and value.strip().isdigit():
                    return int(value)
    except OSError:
        pass
    return 0


def _cgroup_paths(root: str) -> dict[str, str]:
    """The process's memory cgroup path per hierarchy: ``"v2"`` and/or ``"v1"``."""
    paths = {}
    try:
        with open(_under(root, "/proc/self/cgroup"), encoding="ascii") as f:
            for line in f:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) != 3:
                    continue
                _, controllers, path = parts
                if parts[0] == "0" and controllers == "":
                    paths["v2"] = path
                elif "memory" in controllers.split(","):
                    paths["v1"] = path
    except OSError:
        pass
    return paths


def _mounts(root: str) -> dict[str, tuple[str, str]]:
    """(mount root, mount point) of the cgroup2 mount (``"v2"``) and the v1 memory mount (``"v1"``)."""
    mounts = {}
    try:
        with open(_under(root, "/proc/self/mountinfo"), encoding="utf-8") as f:
            for line in f:
                before, _, after = line.partition(" - ")
                fields, tail = before.split(), after.split()
                if len(fields) < 5 or len(tail) < 3:
                    continue
                fstype, options = tail[0], tail[2].split(",")
                if fstype == "cgroup2":
                    mounts.setdefault("v2", (fields[3], fields[4]))
                elif fstype == "cgroup" and "memory" in options:
                    mounts.setdefault("v1", (fields[3], fields[4]))
    except OSError:
        pass
    return mounts


def _cgroup_folder(root: str, mount_root: str, mount_point: str, path: str) -> str:
    """The folder of cgroup ``path`` (as /proc/self/cgroup names it) under its mount.

    A mount of the hierarchy's root holds the path below it; inside a cgroup namespace (or a
    container that mounts only its own cgroup) the mount's root is the process's cgroup itself,
    so the path that /proc/self/cgroup names is not below the mount point: the mount point is it."""
    point = _under(root, mount_point)
    relative = path[len(mount_root):] if path.startswith(mount_root) else path
    folder = os.path.normpath(os.path.join(point, relative.lstrip("/")))
    return folder if os.path.isdir(folder) else point


def cgroup_levels(root: str | os.PathLike | None = None) -> list[CgroupLevel]:
    """Every level of this process's memory cgroup (v2 and v1) that has a limit, from its own
    cgroup up to the top of the hierarchy it can see."""
    root = _root(root)
    paths, mounts = _cgroup_paths(root), _mounts(root)
    files = {"v2": ("memory.max", "memory.current", "inactive_file"),
             "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")}
    levels = []
    for version, (limit_file, usage_file, cache) in files.items():
        if version not in paths or version not in mounts:
            continue
        mount_root, mount_point = mounts[version]
        top = _under(root, mount_point)
        folder = _cgroup_folder(root, mount_root, mount_point, paths[version])
        while True:
            limit = _read_int(os.path.join(folder, limit_file))
            if limit is not None and limit < _UNLIMITED_V1:
                usage = _read_int(os.path.join(folder, usage_file)) or 0
                stat = os.path.join(folder, "memory.stat")
                reclaimable = _stat(stat, cache) or _stat(stat, "inactive_file")
                levels.append(CgroupLevel(folder, limit, max(usage - reclaimable, 0)))
            parent = os.path.dirname(folder)
            if os.path.normpath(folder) == os.path.normpath(top) or parent == folder:
                break
            folder = parent
    return levels


def host_memory(root: str | os.PathLike | None = None, invisible: int = 0) -> HostMemory:
    """RAM and available memory of this process, its cgroups' limits applied. ``invisible``: bytes
    this process holds that its cgroup is not charged for (pinned driver memory on some devices,
    ``DeviceBackend.pinned_in_cgroup``), taken from every cgroup's headroom."""
    base = _root(root)
    info = _meminfo(base)
    ram = info.get("MemTotal") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    available = info.get("MemAvailable")
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    ram_limit = available_limit = None
    for level in cgroup_levels(base):
        if level.limit < ram:
            ram, ram_limit = level.limit, level
        headroom = max(level.headroom - invisible, 0)
        if headroom < available:
            available, available_limit = headroom, level
    return HostMemory(ram, available, ram_limit, available_limit)


def physical_memory(root: str | os.PathLike | None = None) -> int:
    """Bytes of RAM this process may use: the host's, or its cgroup's limit where that is lower."""
    return host_memory(root).ram


def available_memory(root: str | os.PathLike | None = None, backend=None) -> int:
    """Bytes of RAM the kernel could give this process now without swapping or killing it:
    ``MemAvailable``, or its cgroup's limit less its usage where that is lower (less ``backend``'s
    pinned bytes, where its cgroup does not see them)."""
    return host_memory(root, _invisible(backend)).available


def _invisible(backend) -> int:
    if backend is None or getattr(backend, "pinned_in_cgroup", True):
        return 0
    return backend.pinned_memory_allocated()


def auto_pinned_budget(backend, root: str | os.PathLike | None = None) -> int:
    """The "auto" pinned budget: ``AUTO_PINNED_SHARE`` of RAM (its cgroup's limit where lower),
    less what ``backend`` already holds pinned. Logged with the limit it came from."""
    memory = host_memory(root)
    held = backend.pinned_memory_allocated()
    budget = max(0, int(AUTO_PINNED_SHARE * memory.ram) - held)
    logger.info("auto pinned budget %s: %.0f%% of %s%s", size_text(budget), AUTO_PINNED_SHARE * 100, memory.ram_source(),
                f", less {size_text(held)} already pinned" if held else "")
    return budget


def auto_host_budget(backend=None, root: str | os.PathLike | None = None) -> int:
    """The "auto" host budget of ``from_pretrained``: ``AUTO_HOST_SHARE`` of the memory available
    now (see :func:`available_memory`). Logged with the limit it came from."""
    memory = host_memory(root, _invisible(backend))
    budget = int(AUTO_HOST_SHARE * memory.available)
    logger.info("auto host budget %s: %.0f%% of %s", size_text(budget), AUTO_HOST_SHARE * 100, memory.available_source())
    return budget


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
