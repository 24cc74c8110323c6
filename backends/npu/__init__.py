"""In-tree plugin: the Ascend NPU backend ``npu`` (HCCL collectives). Registered like any third-party plugin.

``torch_npu`` is imported by ``NpuBackend.probe()`` (which construction calls), never when this
module is imported: importing it loads the CANN runtime, which takes seconds and fails outright
on machines without one, and listing backends must stay cheap everywhere.

Deviations from the CUDA backend, all inherited from ``torch_npu`` (checked against its
documentation and source; not yet run on Ascend hardware):

* ``pin_memory=True`` allocates page-locked memory only once ``torch_npu`` is imported, because
  importing it registers the NPU host allocator; construction imports it before any allocation.
  Copies from unpinned host memory are synchronous on NPU (the Ascend docs say a non-blocking copy
  has no asynchronous effect without pinned memory).
* HCCL binds its communicator to the *current* device, and the Ascend examples set it before
  ``init_process_group("hccl")`` without ``device_id``; so ``bind_device_id`` is off and
  ``init_process_group`` only calls ``set_device``.
* With ``TASK_QUEUE_ENABLE`` (the default) kernel launches go through a host-side task queue:
  ``Event.query()`` is false until the record has left that queue, never falsely true.
* Streams and events are ``torch.npu.Stream`` and ``torch.npu.Event`` (the device module's, as
  for every accelerator backend): ``NPUGuardImpl`` does not implement the generic
  ``torch.Stream(device=...)`` creation, and torch_npu's ``Event.record``/``wait`` take only NPU
  streams.
* Pinned memory is registered host memory where torch_npu binds the runtime's registration
  (``torch.npu.npurt()``: ``npuHostRegister(ptr, size, flags)`` / ``npuHostUnregister(ptr)``,
  ``aclrtHostRegisterV2`` underneath, flag ``ACL_HOST_REG_PINNED``; names as torch_npu's own test
  of them calls them); else torch_npu's caching host allocator, assumed (unchecked) to round up
  to a power of two as CUDA's does. ``empty_host_cache`` goes through torch_npu's
  ``torch.npu.host_empty_cache`` where that exists, else ``torch.accelerator.empty_host_cache``.
* Pinned memory is driver DMA memory that the process's memory cgroup is not charged for
  (``pinned_in_cgroup = False``): the "auto" host budget takes it from the cgroup's headroom.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from typing import Any

import torch

from offload_core.device.accelerator import AcceleratorBackend
from offload_core.device.backend import Capability
from offload_core.device.hookspecs import hookimpl

__all__ = ["NpuBackend"]

_RUNTIME = "torch_npu"
#: aclrtHostRegisterV2's flag for page-locking (not mapping into the device's address space)
ACL_HOST_REG_PINNED = 0x10000000
_runtime_error: str | None = None  # why the runtime could not be loaded, once it is known


def _npu_module() -> Any:
    """torch's ``npu`` device module, importing the runtime on first use; None if unavailable.

    A failed import is remembered, not retried: a broken CANN install fails slowly, and the
    probe runs on every listing.
    """
    global _runtime_error
    if _runtime_error is not None:
        return None
    if importlib.util.find_spec(_RUNTIME) is None:  # looks on sys.path, imports nothing
        return None
    try:
        importlib.import_module(_RUNTIME)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        _runtime_error = f"importing {_RUNTIME} failed: {type(exc).__name__}: {exc}"
        return None
    module = getattr(torch, "npu", None)
    if module is None:
        _runtime_error = f"{_RUNTIME} was imported but registered no torch 'npu' device module"
    return module


class NpuBackend(AcceleratorBackend):
    """Huawei Ascend NPUs through the device module ``torch_npu`` registers, HCCL for collectives."""

    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    priority = 10
    bind_device_id = False
    pinned_in_cgroup = False

    def __init__(self) -> None:
        super().__init__()
        if callable(getattr(self._mod, "npurt", None)):  # torch_npu binds the runtime's registration
            self.capabilities = type(self).capabilities | {Capability.HOST_REGISTER}

    @classmethod
    def probe(cls) -> bool:
        """True when ``torch_npu`` imports and reports at least one NPU.

        Recent ``torch_npu`` counts devices through the Ascend driver (``drvGetDevNum``) before
        falling back to the ACL runtime, and its ``is_available()`` never calls ``_lazy_init``,
        so probing leaves ``torch_npu.npu.is_initialized()`` false.
        """
        module = _npu_module()
        return module is not None and bool(module.is_available())

    @classmethod
    def unavailable_reason(cls) -> str:
        if _runtime_error is not None:
            return _runtime_error
        if importlib.util.find_spec(_RUNTIME) is None:
            return f"{_RUNTIME} is not installed"
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        where = f" (ASCEND_RT_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"{_RUNTIME} found no NPU device{where}"

    def host_cache_emptier(self):
        """torch_npu's ``torch.npu.host_empty_cache`` (its name for it; there is no
        ``torch.npu.empty_host_cache``), else the generic ``torch.accelerator.empty_host_cache``."""
        return getattr(self._mod, "host_empty_cache", None) or super().host_cache_emptier()

    def _runtime_register(self, ptr: int, nbytes: int) -> None:
        error = int(self._mod.npurt().npuHostRegister(ptr, nbytes, ACL_HOST_REG_PINNED))
        if error != 0:
            raise torch.OutOfMemoryError(f"npuHostRegister of {nbytes} bytes failed: ACL error {error}")

    def _runtime_unregister(self, ptr: int) -> None:
        error = int(self._mod.npurt().npuHostUnregister(ptr))
        if error != 0:
            raise RuntimeError(f"npuHostUnregister at {ptr:#x} failed: ACL error {error}")


@hookimpl
def offload_core_register_backends(register):
    register(NpuBackend)
