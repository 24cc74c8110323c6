"""The import path of :mod:`offload_core.device.hookspecs` that plugins written for 0.1 use.

docs/backends.md told plugin authors to import ``offload_core.hookspecs``; the module moved into
the device layer (``offload_core/device/``), and this path keeps their plugins working unchanged.
New code imports ``offload_core.device.hookspecs`` or ``offload_core.hookimpl``.
"""

from .device.hookspecs import PROJECT, hookimpl, hookspec, offload_core_register_backends

__all__ = ["PROJECT", "hookimpl", "hookspec", "offload_core_register_backends"]
