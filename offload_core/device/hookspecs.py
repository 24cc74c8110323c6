"""The plugin API: the hooks a backend distribution implements.

A backend plugin is a plain module named by an entry point in the ``offload_core`` group of its
distribution's metadata::

    [project.entry-points.offload_core]
    acme = "acme_offload.backend"

That module implements the hooks below, decorated with :data:`offload_core.hookimpl`. The in-tree
fake, CUDA and NPU backends are registered exactly this way, so a vendor's plugin is a peer of
theirs, and is preferred to them by auto-detection when its ``probe()`` is true.
"""

from __future__ import annotations

from typing import Callable

import pluggy

__all__ = ["PROJECT", "hookimpl", "hookspec", "offload_core_register_backends"]

PROJECT = "offload_core"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def offload_core_register_backends(register: Callable[[type], None]) -> None:
    """Register the backend classes this plugin provides.

    Call ``register(cls)`` once per :class:`offload_core.DeviceBackend` subclass. The class
    carries everything selection needs as class attributes: ``name`` (letters, digits, ``_``,
    ``.``, ``-``; not taken by another plugin nor by an in-tree backend), ``priority`` (an int)
    and ``is_accelerator`` (a bool), and the classmethod ``probe()``. Do not instantiate the
    class or touch a device here: the hook runs in every process that imports offload_core, with
    or without the plugin's hardware. A registration that breaks these rules is reported and
    skipped, as is a hook or a module import that raises anything.

    Importing the plugin module must not import the vendor's runtime either (import it inside
    ``probe()`` or the backend's ``__init__``), so that listing backends stays cheap and a
    missing runtime makes the backend unavailable instead of breaking the import; nor use
    ``offload_core.get_backend()`` at import time, while the registry is being built.
    """
