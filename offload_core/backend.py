"""The import path of :mod:`offload_core.device.backend` that plugins written for 0.1 use.

docs/backends.md told plugin authors to import ``offload_core.backend``; the module moved into the
device layer (``offload_core/device/``), and this path keeps their plugins working unchanged.
New code imports ``offload_core.device.backend`` or the names from ``offload_core``.
"""

from .device.backend import Capability, DeviceBackend, Event, Stream, Waitable

__all__ = ["DeviceBackend", "Event", "Stream", "Waitable", "Capability"]
