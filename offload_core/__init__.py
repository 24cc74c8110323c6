"""offload-core: run diffusion pipelines on accelerators too small for them.

Weights live in pinned host memory and stream to the device when needed, through a pluggable
:class:`DeviceBackend`. See ``docs/index.md`` for which strategy to choose.

The names below are imported when first used, not with the package (PEP 562): ``import
offload_core`` alone imports neither torch nor diffusers, so that the pytest plugin this package
registers, ``offload-core --help`` and ``--version`` cost nothing in a process that does not
offload; ``import offload_core`` costs what the first name used costs.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the submodule defining it
_EXPORTS = {
    "enable_offload": ".api",
    "AcceleratorBackend": ".device.accelerator",
    "Capability": ".device.backend",
    "DeviceBackend": ".device.backend",
    "Event": ".device.backend",
    "Stream": ".device.backend",
    "Waitable": ".device.backend",
    "OffloadConfig": ".common.config",
    "register_blocks": ".discovery",
    "AlreadyEnabledError": ".base.errors",
    "BackendNotFoundError": ".base.errors",
    "BlockDiscoveryError": ".base.errors",
    "CheckpointError": ".base.errors",
    "DistributedOffloadError": ".base.errors",
    "OffloadConfigError": ".base.errors",
    "OffloadedModelError": ".base.errors",
    "RepackError": ".base.errors",
    "UnsupportedTensorError": ".base.errors",
    "OffloadHandle": ".handle",
    "hookimpl": ".device.hookspecs",
    "BackendInfo": ".device.plugins",
    "get_backend": ".device.plugins",
    "list_backends": ".device.plugins",
    "from_pretrained": ".pretrained.load",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what IDEs and type checkers see
    from .api import enable_offload
    from .common.config import OffloadConfig
    from .device.accelerator import AcceleratorBackend
    from .device.backend import Capability, DeviceBackend, Event, Stream, Waitable
    from .device.hookspecs import hookimpl
    from .device.plugins import BackendInfo, get_backend, list_backends
    from .discovery import register_blocks
    from .base.errors import (
        AlreadyEnabledError, BackendNotFoundError, BlockDiscoveryError, CheckpointError, DistributedOffloadError,
        OffloadConfigError, OffloadedModelError, RepackError, UnsupportedTensorError,
    )
    from .handle import OffloadHandle
    from .pretrained.load import from_pretrained

def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
