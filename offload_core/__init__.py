"""offload-core: run diffusion pipelines on accelerators too small for them.

Weights live in pinned host memory and stream to the device when needed, through a pluggable
:class:`DeviceBackend`. See ``docs/index.md`` for which strategy to choose.
"""

from .api import enable_offload
from .backend import Capability, DeviceBackend, Event, Stream, Waitable
from .hookspecs import hookimpl
from .config import OffloadConfig, OffloadConfigError
from .discovery import BlockDiscoveryError, register_blocks
from .handle import AlreadyEnabledError, OffloadHandle
from .plugins import BackendInfo, BackendNotFoundError, get_backend, list_backends
from .pretrained import from_pretrained
from .weights import UnsupportedTensorError

__all__ = [
    "AlreadyEnabledError",
    "BackendInfo",
    "BlockDiscoveryError",
    "OffloadConfig",
    "OffloadConfigError",
    "OffloadHandle",
    "UnsupportedTensorError",
    "enable_offload",
    "from_pretrained",
    "register_blocks",
    "BackendNotFoundError",
    "Capability",
    "DeviceBackend",
    "Event",
    "Stream",
    "Waitable",
    "get_backend",
    "hookimpl",
    "list_backends",
]
__version__ = "0.1.0"
