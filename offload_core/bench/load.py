"""How busy the machine was during a benchmark run: the load average and the share of CPU time
stolen by the hypervisor, from ``/proc/stat``. Printed with every run, since on a shared or
virtual machine other work moves every timing figure."""

from __future__ import annotations

import os
from typing import Any

#: /proc/stat's "cpu" line: user nice system idle iowait irq softirq steal ...
STEAL_FIELD = 7


def cpu_times() -> list[int] | None:
    """The aggregate CPU times of ``/proc/stat`` (jiffies), or None where there is none."""
    try:
        with open("/proc/stat", encoding="ascii") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    return [int(x) for x in fields[1:]] if fields and fields[0] == "cpu" else None


class LoadMeter:
    """The load average at the start and end of a run, and the CPU steal share in between."""

    def __init__(self) -> None:
        self.start_times = cpu_times()
        self.start_load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None

    def figures(self) -> dict[str, Any]:
        end_times = cpu_times()
        steal = None
        if self.start_times is not None and end_times is not None and len(end_times) > STEAL_FIELD:
            delta = [b - a for a, b in zip(self.start_times, end_times)]
            total = sum(delta[:STEAL_FIELD + 1])  # guest time is counted inside user time already
            steal = delta[STEAL_FIELD] / total if total > 0 else 0.0
        return {
            "cores": os.cpu_count(),
            "load_average_start": self.start_load,
            "load_average_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "cpu_steal_fraction": steal,
        }


def describe(load: dict[str, Any]) -> str:
    parts = [f"{load['cores']} cores"]
    if load["load_average_start"] is not None:
        parts.append(f"load average {load['load_average_start']:.2f} at the start, {load['load_average_end']:.2f} "
                     "at the end")
    if load["cpu_steal_fraction"] is not None:
        parts.append(f"CPU steal {load['cpu_steal_fraction']:.1%} during the run")
    return "machine: " + ", ".join(parts)
