"""What ci/gpu_check.py reads of the host around the device: the GPU's PCIe link and NUMA node,
the NUMA node of the memory offload-core pins homes in, and the process's locked memory. Each
fact is read where the machine offers it (``nvidia-smi``, ``/sys``, ``/proc``) and, where it does
not (a dry run, a container without sysfs), left None with the reason named.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any


def proc_status(*keys: str) -> dict[str, int | None]:
    """Fields of ``/proc/self/status`` in bytes (``VmPin``, ``VmLck``); None where not readable."""
    values: dict[str, int | None] = dict.fromkeys(keys)
    try:
        for line in Path("/proc/self/status").read_text(encoding="ascii").splitlines():
            name, _, rest = line.partition(":")
            if name in values and rest.strip().endswith("kB"):
                values[name] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values


def numa_node_of(address: int) -> int | None:
    """The NUMA node holding the page at ``address`` of this process (``/proc/self/numa_maps``:
    the node of the mapping that contains it, where the kernel reports one); None where unknown."""
    try:
        lines = Path("/proc/self/numa_maps").read_text(encoding="ascii").splitlines()
    except OSError:
        return None
    starts = []
    for line in lines:
        fields = line.split()
        nodes = [f for f in fields if f.startswith("N") and "=" in f]
        starts.append((int(fields[0], 16), nodes))
    starts.sort()
    holding = [nodes for start, nodes in starts if start <= address]
    if not holding or not holding[-1]:
        return None
    best = max(holding[-1], key=lambda f: int(f.split("=")[1]))
    return int(best[1:].split("=")[0])


def link_facts(dry_run: bool, backend: Any) -> dict[str, Any]:
    """The GPU's PCIe link (generation and width, current and maximum, from ``nvidia-smi``; the
    speed and width sysfs gives for the same device beside them) and NUMA node (``/sys/bus/pci``),
    and the node of the host memory offload-core pins homes in; each fact None with the reason in
    ``unavailable`` where this machine cannot tell it. (An idle GPU may train its link down:
    the current generation can read below the maximum until work runs.)"""
    facts: dict[str, Any] = {"pcie_generation": None, "pcie_generation_max": None, "pcie_width": None,
                             "pcie_width_max": None, "gpu_numa_node": None, "pci_bus_id": None, "home_numa_node": None,
                             "unavailable": {}}
    if not dry_run and shutil.which("nvidia-smi"):
        query = "pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max"
        done = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-i", "0"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0 and done.stdout.strip():
            bus, gen, gen_max, width, width_max = (f.strip() for f in done.stdout.splitlines()[0].split(","))
            facts.update(pci_bus_id=bus, pcie_generation=_number(gen), pcie_generation_max=_number(gen_max),
                         pcie_width=_number(width), pcie_width_max=_number(width_max))
        else:
            facts["unavailable"]["nvidia-smi"] = (done.stderr or done.stdout).strip()[:200]
    elif dry_run:
        facts["unavailable"]["pcie"] = "dry run: no GPU to ask nvidia-smi about"
    else:
        facts["unavailable"]["pcie"] = "nvidia-smi not found"
    if facts["pci_bus_id"]:
        device = Path("/sys/bus/pci/devices") / _sysfs_bus_id(facts["pci_bus_id"])
        for name in ("current_link_speed", "max_link_speed", "current_link_width", "max_link_width"):
            try:
                facts[f"sysfs_{name}"] = (device / name).read_text().strip()  # "32.0 GT/s PCIe" is gen 5
            except OSError as exc:
                facts["unavailable"][f"sysfs_{name}"] = str(exc)
        try:
            node = int((device / "numa_node").read_text().strip())
            facts["gpu_numa_node"] = node if node >= 0 else None  # -1: one node, or the firmware did not say
            if node < 0:
                facts["unavailable"]["gpu_numa_node"] = "the kernel reports -1 (no NUMA affinity)"
        except OSError as exc:
            facts["unavailable"]["gpu_numa_node"] = str(exc)
    else:
        facts["unavailable"].setdefault("gpu_numa_node", "no PCI bus id of a GPU")
    home = _home_numa_node(backend) if backend is not None else None
    facts["home_numa_node"] = home
    if home is None:
        facts["unavailable"]["home_numa_node"] = "/proc/self/numa_maps names no node for a pinned home"
    facts["numa_nodes"] = sorted(int(p.name[4:]) for p in Path("/sys/devices/system/node").glob("node[0-9]*")) or None
    return facts


def _number(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _sysfs_bus_id(bus_id: str) -> str:
    """nvidia-smi's ``00000000:3B:00.0`` as sysfs names it, ``0000:3b:00.0``."""
    parts = bus_id.split(":")
    if len(parts) != 3:
        return bus_id.lower()
    return f"{int(parts[0], 16) & 0xFFFF:04x}:{parts[1].lower()}:{parts[2].lower()}"


def _home_numa_node(backend: Any) -> int | None:
    """The node of a pinned home offload-core makes on ``backend``: a small stack offloaded, its
    first home's first page asked of ``numa_maps``."""
    import offload_core
    from torch import nn

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(2))

    model = Stack()
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
    try:
        homes = [t for p in handle.parts for u in getattr(p, "units", []) for t in (u.host or {}).values()]
        return numa_node_of(homes[0].data_ptr()) if homes else None
    finally:
        handle.disable()
