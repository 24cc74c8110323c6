"""The import path of :mod:`offload_core.device.accelerator` that plugins written for 0.1 use.

docs/backends.md told plugin authors to import ``offload_core.accelerator``; the module moved into
the device layer (``offload_core/device/``), and this path keeps their plugins working unchanged.
New code imports ``offload_core.device.accelerator`` or ``offload_core.AcceleratorBackend``.
"""

from .device.accelerator import AcceleratorBackend, BackendUnavailableError, CollectiveWork

__all__ = ["AcceleratorBackend", "BackendUnavailableError", "CollectiveWork"]
