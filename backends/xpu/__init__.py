"""In-tree plugin: the Intel XPU backend ``xpu`` (XCCL collectives where this torch has them).
Registered like any third-party plugin.

Everything but the probe is the generic :class:`offload_core.device.accelerator.AcceleratorBackend`:
torch's ``xpu`` device module has the same stream model as CUDA's (``torch.xpu.Stream``,
``torch.xpu.Event`` with timing, ``torch.xpu.stream`` contexts, ``current_stream``, ``synchronize``,
the memory figures, ``mem_get_info``), and ``pin_memory=True`` pins through the XPU host
allocator. Built from torch's documentation and source; not yet run on Intel hardware. Where it
may differ from CUDA (see docs/backends.md, "Intel XPU"):

* collectives go through ``xccl`` where this torch was built with it; otherwise there is no
  collective library for XPU tensors (gloo moves host tensors only), so the backend then lists no
  collectives capability: distributed offloading on XPU needs a torch built with XCCL;
* the communicator is bound by setting the current device before joining the group, not through
  ``device_id`` (as for HCCL): whether XCCL binds eagerly from ``device_id`` is not checked;
* the pinned host cache is emptied through ``torch.accelerator.empty_host_cache`` (torch 2.12 and
  later; ``torch.xpu`` has no call of its own), else it stays cached and counted.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from offload_core.device.accelerator import AcceleratorBackend
from offload_core.device.backend import Capability
from offload_core.device.hookspecs import hookimpl

__all__ = ["XpuBackend"]


def _has_xccl() -> bool:
    """Whether this torch was built with XCCL (``is_xccl_available`` is new in torch 2.8)."""
    available = getattr(dist, "is_xccl_available", None)
    return bool(available is not None and available())


class XpuBackend(AcceleratorBackend):
    """Intel GPUs through torch's XPU device module, XCCL for collectives where torch has it."""

    name = "xpu"
    device_type = "xpu"
    dist_backend = "xccl" if _has_xccl() else "gloo"
    priority = 10
    bind_device_id = False
    capabilities = AcceleratorBackend.capabilities if _has_xccl() else AcceleratorBackend.capabilities - {
        Capability.COLLECTIVES}

    @classmethod
    def probe(cls) -> bool:
        """True when torch was built with XPU and at least one device is visible.

        ``torch.xpu.device_count()`` asks Level Zero Sysman first (torch 2.13; it does not poison a
        later fork) and never calls ``torch.xpu._lazy_init``, so ``torch.xpu.is_initialized()``
        stays false; on a torch built without XPU it is 0 without asking anything."""
        return torch.xpu.device_count() > 0

    @classmethod
    def unavailable_reason(cls) -> str:
        if not torch.xpu._is_compiled():
            return f"this torch build ({torch.__version__}) has no XPU support"
        visible = os.environ.get("ZE_AFFINITY_MASK")
        where = f" (ZE_AFFINITY_MASK={visible!r})" if visible is not None else ""
        return f"no XPU device is visible{where}"


@hookimpl
def offload_core_register_backends(register):
    register(XpuBackend)
