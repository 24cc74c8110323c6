"""The "auto" host budgets see the memory cgroup the process runs in (v1 and v2, nested, inside a
cgroup namespace), read from a fake system tree (``OFFLOAD_CORE_SYSTEM_ROOT`` / ``root=``)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import offload_core
from offload_core.hostmem import machine

from fake_system import GIB, HOST_AVAILABLE, HOST_RAM, UNLIMITED_V1, V1_MOUNTS, V2_MOUNT, system, v1_level, v2_level

class Pinned:
    """What the budgets ask of a backend."""

    def __init__(self, held: int = 0, in_cgroup: bool = True) -> None:
        self.held, self.pinned_in_cgroup = held, in_cgroup

    def pinned_memory_allocated(self) -> int:
        return self.held


def test_cgroup_v2_limit_less_usage_without_reclaimable_cache(tmp_path, caplog):
    folder = "/sys/fs/cgroup/user.slice/app.scope"
    root = system(tmp_path, "0::/user.slice/app.scope", V2_MOUNT, v2_level(folder, 24 * GIB, 10 * GIB, 4 * GIB))
    memory = machine.host_memory(root)
    assert memory.ram == 24 * GIB and memory.available == 18 * GIB  # 24 - (10 - 4)
    assert machine.physical_memory(root) == 24 * GIB and machine.available_memory(root) == 18 * GIB
    with caplog.at_level(logging.INFO, logger="offload_core.hostmem.machine"):
        assert machine.auto_pinned_budget(Pinned(), root) == 12 * GIB
        assert machine.auto_host_budget(None, root) == int(0.9 * 18 * GIB)
    text = caplog.text
    assert f"auto pinned budget 12.0 GiB: 50% of the cgroup limit 24.0 GiB ({root}{folder})" in text
    assert f"auto host budget 16.2 GiB: 90% of the cgroup limit 24.0 GiB less its usage 6.0 GiB ({root}{folder})" in text


def test_a_parents_lower_limit_applies_and_max_is_no_limit(tmp_path):
    files = {**v2_level("/sys/fs/cgroup/kubepods/pod1/ctr", "max", 3 * GIB, 0),
             **v2_level("/sys/fs/cgroup/kubepods/pod1", 8 * GIB, 5 * GIB, GIB),
             **v2_level("/sys/fs/cgroup/kubepods", 32 * GIB, 20 * GIB, 0)}
    root = system(tmp_path, "0::/kubepods/pod1/ctr", V2_MOUNT, files)
    memory = machine.host_memory(root)
    assert memory.ram == 8 * GIB and memory.ram_limit.path == f"{root}/sys/fs/cgroup/kubepods/pod1"
    assert memory.available == 4 * GIB  # the pod's 8 - (5 - 1); the top level's 32 - 20 is more
    assert [level.limit for level in machine.cgroup_levels(root)] == [8 * GIB, 32 * GIB]


def test_cgroup_v1_nested_with_the_unlimited_value(tmp_path):
    files = {**v1_level("/sys/fs/cgroup/memory/docker/abc", UNLIMITED_V1, 2 * GIB, 0),
             **v1_level("/sys/fs/cgroup/memory/docker", 16 * GIB, 6 * GIB, GIB),
             **v1_level("/sys/fs/cgroup/memory", UNLIMITED_V1, 40 * GIB, 0)}
    root = system(tmp_path, "9:name=systemd:/docker/abc\n4:memory:/docker/abc\n0::/docker/abc",
                  V1_MOUNTS.format(root="/"), files)
    assert machine.physical_memory(root) == 16 * GIB
    assert machine.available_memory(root) == 11 * GIB  # 16 - (6 - 1): total_inactive_file, not inactive_file
    assert machine.auto_pinned_budget(Pinned(held=GIB), root) == 7 * GIB  # half of 16, less what is pinned


def test_inside_a_cgroup_namespace_the_mount_is_the_process_cgroup(tmp_path):
    # /proc/self/cgroup names the cgroup from the host's root; the files are at the mount point
    files = v1_level("/sys/fs/cgroup/memory", 12 * GIB, 2 * GIB, 0)
    # a child of the process's cgroup that shares the path's first name: not the process's
    files.update(v1_level("/sys/fs/cgroup/memory/process_api", GIB, 0, 0))
    root = system(tmp_path, "4:memory:/process_api/f1a7e0d0", V1_MOUNTS.format(root="/"), files)
    assert machine.physical_memory(root) == 12 * GIB and machine.available_memory(root) == 10 * GIB
    # a container runtime that mounts its own cgroup as the root of the mount: the same folder
    other = system(tmp_path / "other", "4:memory:/docker/abc", V1_MOUNTS.format(root="/docker/abc"), files)
    assert machine.physical_memory(other) == 12 * GIB


def test_no_cgroup_limit_leaves_the_hosts_figures(tmp_path, monkeypatch, caplog):
    root = system(tmp_path, "0::/user.slice", V2_MOUNT, v2_level("/sys/fs/cgroup/user.slice", "max", GIB, 0))
    monkeypatch.setenv(machine.SYSTEM_ROOT_ENV, str(root))  # the environment variable, no root=
    assert machine.cgroup_levels() == []
    assert machine.physical_memory() == HOST_RAM and machine.available_memory() == HOST_AVAILABLE
    with caplog.at_level(logging.INFO, logger="offload_core.hostmem.machine"):
        machine.auto_pinned_budget(Pinned())
    assert "auto pinned budget 32.0 GiB: 50% of physical RAM 64.0 GiB" in caplog.text


def test_pinned_memory_the_cgroup_does_not_see_comes_off_its_headroom(tmp_path):
    root = system(tmp_path, "0::/app", V2_MOUNT, v2_level("/sys/fs/cgroup/app", 24 * GIB, 4 * GIB, 0))
    assert machine.available_memory(root, Pinned(held=6 * GIB)) == 20 * GIB  # charged to the cgroup already
    assert machine.available_memory(root, Pinned(held=6 * GIB, in_cgroup=False)) == 14 * GIB
    assert machine.auto_host_budget(Pinned(held=6 * GIB, in_cgroup=False), root) == int(0.9 * 14 * GIB)


def test_the_npu_backend_declares_its_pinned_memory_invisible_to_the_cgroup():
    from offload_core_cuda import CudaBackend
    from offload_core_npu import NpuBackend

    assert NpuBackend.pinned_in_cgroup is False and CudaBackend.pinned_in_cgroup is True


# -- end to end: an enable under a small cgroup limit --------------------------------------------------


class Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(256, 256, bias=False) for _ in range(8))  # 256 KiB each
        for block in self.blocks:
            block.weight.data = torch.randn(256, 256, generator=g) / 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return x


@pytest.mark.fake_only
def test_the_auto_pinned_budget_of_an_enable_shrinks_to_the_cgroup_limit(tmp_path, monkeypatch, caplog):
    model = Stack()
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    limit = 2 * 2**20  # auto pinned: half of it, 1 MiB, on a 64 GiB host
    root = system(tmp_path, "0::/app", V2_MOUNT, v2_level("/sys/fs/cgroup/app", limit, 0, 0))
    monkeypatch.setenv(machine.SYSTEM_ROOT_ENV, str(root))
    backend = offload_core.get_backend("fake", chaos=False)
    with caplog.at_level(logging.INFO, logger="offload_core.hostmem.machine"):
        handle = offload_core.enable_offload(model, backend=backend, enable_layerwise_offload=True)
    assert f"auto pinned budget 1.0 MiB: 50% of the cgroup limit 2.0 MiB ({root}/sys/fs/cgroup/app)" in caplog.text
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    stats = handle.stats()
    assert 0 < stats["pinned_host_bytes"] <= limit // 2
    assert stats["pageable_host_bytes"] >= 4 * 256 * 256 * 4  # at least half the blocks did not fit
    handle.disable()
