"""In-tree plugin: the CUDA backend ``cuda`` (NCCL collectives). Registered like any third-party plugin.

Everything but the probe is the generic :class:`offload_core.device.accelerator.AcceleratorBackend`;
ROCm builds of torch expose HIP devices as ``cuda`` and are served by this backend as well.
"""

from __future__ import annotations

import os

import torch

from offload_core.device.accelerator import AcceleratorBackend
from offload_core.device.backend import Capability
from offload_core.device.hookspecs import hookimpl

__all__ = ["CudaBackend"]


class CudaBackend(AcceleratorBackend):
    """NVIDIA (or ROCm) GPUs through torch's CUDA device module, NCCL for collectives."""

    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    priority = 10
    # cudaHostRegister / cudaHostUnregister are bound in torch.cuda.cudart() of every CUDA and
    # ROCm (hipHostRegister, under the same names) build of torch
    capabilities = AcceleratorBackend.capabilities | {Capability.HOST_REGISTER}

    @classmethod
    def probe(cls) -> bool:
        """True when torch was built with CUDA and at least one device is visible.

        Uses ``torch.cuda.device_count()``, not ``is_available()``: ``device_count()`` (read in
        torch 2.13's source) asks NVML first and never calls ``torch.cuda._lazy_init``, so no CUDA
        context is created and ``torch.cuda.is_initialized()`` stays false, while
        ``is_available()`` goes through ``cudaGetDeviceCount`` (hence ``cuInit``) unless
        ``PYTORCH_NVML_BASED_CUDA_CHECK=1``. Only where NVML itself fails (no
        ``libnvidia-ml.so.1``, MIG UUIDs in ``CUDA_VISIBLE_DEVICES``) does ``device_count()``
        fall back to ``cudaGetDeviceCount``: still no torch CUDA state, but the driver is then
        initialised, which makes a later ``fork`` unsafe for CUDA in the child.

        NVML counts devices, it does not prove they work (a driver too old for this torch still
        counts): such a machine probes true and fails at the first device call. The count is 0
        on a torch built without CUDA, so no separate build check is needed.
        """
        return torch.cuda.device_count() > 0

    @classmethod
    def unavailable_reason(cls) -> str:
        if torch.version.cuda is None and torch.version.hip is None:
            return f"this torch build ({torch.__version__}) has no CUDA support"
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return f"no CUDA device is visible{where}"

    def host_cache_emptier(self):
        """``torch._C._host_emptyCache`` (what ``torch.cuda.graphs`` itself calls; CUDA builds
        only), else the generic ``torch.accelerator.empty_host_cache``. There is no
        ``torch.cuda.empty_host_cache``: looking for one silently did nothing."""
        return getattr(torch._C, "_host_emptyCache", None) or super().host_cache_emptier()

    def _runtime_register(self, ptr: int, nbytes: int) -> None:
        """``cudaHostRegister(ptr, nbytes, cudaHostRegisterDefault)``: page-locks exactly the range
        (no rounding). ``cudart()`` initialises CUDA, which a backend in use has done already."""
        cudart = self._mod.cudart()
        error = cudart.cudaHostRegister(ptr, nbytes, 0)
        if error != cudart.cudaError.success:
            raise torch.OutOfMemoryError(
                f"cudaHostRegister of {nbytes} bytes failed: {cudart.cudaGetErrorString(error)}")

    def _runtime_unregister(self, ptr: int) -> None:
        cudart = self._mod.cudart()
        error = cudart.cudaHostUnregister(ptr)
        if error != cudart.cudaError.success:
            raise RuntimeError(f"cudaHostUnregister at {ptr:#x} failed: {cudart.cudaGetErrorString(error)}")


@hookimpl
def offload_core_register_backends(register):
    register(CudaBackend)
