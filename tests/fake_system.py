"""A fake system tree for the host-memory budgets (``OFFLOAD_CORE_SYSTEM_ROOT`` / ``root=``): a
host's /proc/meminfo, the process's cgroup and mount table, and cgroup files, v1 and v2."""

from __future__ import annotations

from pathlib import Path

GIB = 2**30
HOST_RAM, HOST_AVAILABLE = 64 * GIB, 60 * GIB
V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
    "35 31 0:32 {root} /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw"
)
UNLIMITED_V1 = 9223372036854771712


def system(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, object]) -> Path:
    """A fake root: /proc/meminfo of a 64 GiB host, the process's cgroup and mount table, and the
    cgroup files (path -> content)."""
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    (tmp_path / "proc" / "meminfo").write_text(
        f"MemTotal:       {HOST_RAM // 1024} kB\nMemFree:        1000 kB\nMemAvailable:   {HOST_AVAILABLE // 1024} kB\n")
    (proc / "cgroup").write_text(cgroup + "\n")
    (proc / "mountinfo").write_text(mountinfo + "\n")
    for path, content in files.items():
        target = tmp_path / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(f"{content}\n")
    return tmp_path


def v2_level(folder: str, limit, usage: int, inactive: int) -> dict[str, object]:
    return {f"{folder}/memory.max": limit, f"{folder}/memory.current": usage,
            f"{folder}/memory.stat": f"anon {usage - inactive}\nfile {inactive}\ninactive_file {inactive}\nactive_file 0"}


def v1_level(folder: str, limit: int, usage: int, inactive: int) -> dict[str, object]:
    # inactive_file is the cgroup's own; total_inactive_file its whole subtree, as usage is
    return {f"{folder}/memory.limit_in_bytes": limit, f"{folder}/memory.usage_in_bytes": usage,
            f"{folder}/memory.stat": f"cache {inactive}\ninactive_file 0\ntotal_inactive_file {inactive}"}
