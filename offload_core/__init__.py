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
    "Capability": ".backend",
    "DeviceBackend": ".backend",
    "Event": ".backend",
    "Stream": ".backend",
    "Waitable": ".backend",
    "hookimpl": ".hookspecs",
    "OffloadConfig": ".config",
    "OffloadConfigError": ".config",
    "BlockDiscoveryError": ".discovery",
    "register_blocks": ".discovery",
    "AlreadyEnabledError": ".handle",
    "OffloadedModelError": ".handle",
    "OffloadHandle": ".handle",
    "RepackError": ".strategies.part",
    "DistributedOffloadError": ".strategies.distributed",
    "BackendInfo": ".plugins",
    "BackendNotFoundError": ".plugins",
    "get_backend": ".plugins",
    "list_backends": ".plugins",
    "from_pretrained": ".pretrained",
    "UnsupportedTensorError": ".weights",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # what IDEs and type checkers see
    from .api import enable_offload
    from .backend import Capability, DeviceBackend, Event, Stream, Waitable
    from .config import OffloadConfig, OffloadConfigError
    from .discovery import BlockDiscoveryError, register_blocks
    from .handle import AlreadyEnabledError, OffloadedModelError, OffloadHandle
    from .hookspecs import hookimpl
    from .plugins import BackendInfo, BackendNotFoundError, get_backend, list_backends
    from .pretrained import from_pretrained
    from .strategies.distributed import DistributedOffloadError
    from .strategies.part import RepackError
    from .weights import UnsupportedTensorError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
