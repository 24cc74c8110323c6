"""Which modules belong to which live offload handle, and the torch hooks that tell a handle
when someone changes its model.

Ownership: every module (and parameter) under an enabled handle is recorded here, so that enabling
offload on anything that contains, or is contained in, an offloaded model is refused with an error
naming the handle that owns it: two handles moving the same tensors would fight over them.

Changes: three process-wide torch hooks route to the owning handle, and cost a dictionary lookup
for every other module:

* module, parameter and buffer registration (a LoRA layer injected, a Parameter replaced, a block
  swapped): the owning part is marked ``dirty`` and re-packs before its next use;
* ``nn.Module._apply``, behind ``.to()``, ``.half()``, ``.float()``, ``.cuda()``, ``.cpu()`` and
  the like: the handle decides before anything changes (see :meth:`OffloadHandle._on_apply`).
  torch has no hook for ``_apply``, so the method is wrapped once, process-wide, the first time
  offloading is enabled; modules no handle owns go straight to the original.
"""

from __future__ import annotations

import functools
import threading
import weakref
from typing import Any, Iterable

from torch import nn
from torch.nn.modules import module as torch_module

from .errors import AlreadyEnabledError

_lock = threading.Lock()
#: id(module) -> (weak module, weak handle, weak part): nothing here keeps a model alive, so a model
#: dropped without ``disable()`` is collected with its handle, and the handle's memory goes with it
_modules: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref]] = {}
#: id(parameter) -> (weak parameter, weak handle)
_params: dict[int, tuple[weakref.ref, weakref.ref]] = {}
#: id(handle) -> the keys it registered
_keys: dict[int, tuple[list[int], list[int]]] = {}
_installed = False
_original_apply = nn.Module._apply


def owner_of(module: nn.Module) -> tuple[Any, Any] | None:
    """(handle, part) owning ``module``, or None."""
    found = _modules.get(id(module))
    if found is None or found[0]() is not module:
        return None
    handle, part = found[1](), found[2]()
    return None if handle is None or part is None else (handle, part)


def register(handle: Any) -> None:
    """Record every module and parameter under the handle's enabled parts."""
    install_hooks()
    mods: list[int] = []
    params: list[int] = []
    ref = weakref.ref(handle)
    with _lock:
        for part in handle.parts:
            if not part.enabled:
                continue
            for root in part.modules():
                for module in root.modules():
                    _modules[id(module)] = (weakref.ref(module), ref, weakref.ref(part))
                    mods.append(id(module))
                for p in root.parameters():
                    _params[id(p)] = (weakref.ref(p), ref)
                    params.append(id(p))
        _keys[id(handle)] = (mods, params)


def unregister(handle: Any) -> None:
    with _lock:
        mods, params = _keys.pop(id(handle), ([], []))
        for key in mods:
            found = _modules.get(key)
            if found is not None and found[1]() in (handle, None):
                del _modules[key]
        for key in params:
            found = _params.get(key)
            if found is not None and found[1]() in (handle, None):
                del _params[key]


def refresh(handle: Any) -> None:
    """After a re-pack: the modules and parameters the handle owns may have changed."""
    unregister(handle)
    if handle.enabled:
        register(handle)


def check_free(modules: Iterable[nn.Module], what: str) -> None:
    """Raise if any of ``modules`` (or a module or parameter inside them) is already offloaded."""

    for root in modules:
        for name, module in root.named_modules():
            found = owner_of(module)
            if found is not None:
                where = f"its submodule {name}" if name else f"this {type(module).__name__}"
                raise AlreadyEnabledError(
                    f"offloading is already enabled on {where} (part of {what}), by {found[0]!r}: one module can be "
                    "offloaded by one handle only; call that handle's disable() first"
                )
        for name, p in root.named_parameters():
            found = _params.get(id(p))
            handle = found[1]() if found is not None and found[0]() is p else None
            if handle is not None:
                raise AlreadyEnabledError(
                    f"offloading is already enabled on parameter {name} of {what} (shared with a model offloaded by "
                    f"{handle!r}); call that handle's disable() first"
                )


# -- hooks ----------------------------------------------------------------------------------
def install_hooks() -> None:
    global _installed
    with _lock:
        if _installed:
            return
        torch_module.register_module_parameter_registration_hook(functools.partial(_registered, "parameter"))
        torch_module.register_module_buffer_registration_hook(functools.partial(_registered, "buffer"))
        torch_module.register_module_module_registration_hook(functools.partial(_registered, "module"))
        nn.Module._apply = _apply
        _installed = True


def _registered(kind: str, module: nn.Module, name: str, value: Any) -> None:
    """A module, parameter or buffer is being registered on ``module``. New structure (a module,
    a parameter, a buffer under a new name) makes the owning part re-pack before its next use. A
    buffer re-assigned under its old name is not structure: a forward that replaces its step
    counter must not re-pack the model on every call; the value is kept when the unit next goes
    home (see ``weights.binding``)."""
    found = owner_of(module)
    if found is None:
        return None
    handle, part = found
    if handle._busy:
        return None
    if kind == "buffer" and name in module._buffers:
        return None
    part.dirty = True
    return None


def _apply(self: nn.Module, fn, recurse: bool = True):
    found = owner_of(self)
    if found is None:
        return _original_apply(self, fn, recurse)
    handle, part = found
    return handle._on_apply(part, self, fn, recurse, _original_apply)
