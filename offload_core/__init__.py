"""offload-core: run diffusion pipelines on accelerators too small for them.

Weights live in pinned host memory and stream to the device when needed, through a pluggable
:class:`DeviceBackend`. See ``docs/index.md`` for which strategy to choose.

The public names are imported on first use (PEP 562): ``import offload_core`` alone imports
neither torch nor diffusers, so that the pytest plugin this package registers, and a command's
``--help``, cost nothing in a process that does not offload.
"""

from __future__ import annotations

import importlib
from typing import Any

#: public name -> the module that defines it
_HOMES = {
    "AlreadyEnabledError": ".handle",
    "BackendInfo": ".plugins",
    "BackendNotFoundError": ".plugins",
    "BlockDiscoveryError": ".discovery",
    "Capability": ".backend",
    "DeviceBackend": ".backend",
    "DistributedOffloadError": ".strategies.distributed",
    "Event": ".backend",
    "OffloadConfig": ".config",
    "OffloadConfigError": ".config",
    "OffloadHandle": ".handle",
    "OffloadedModelError": ".handle",
    "RepackError": ".strategies.part",
    "Stream": ".backend",
    "UnsupportedTensorError": ".weights",
    "Waitable": ".backend",
    "enable_offload": ".api",
    "from_pretrained": ".pretrained",
    "get_backend": ".plugins",
    "hookimpl": ".hookspecs",
    "list_backends": ".plugins",
    "register_blocks": ".discovery",
}

__all__ = sorted(_HOMES)
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(home, __name__), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))
