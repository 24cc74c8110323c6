"""Reacting to what users do to an offloaded model: which handle owns which module, the torch
hooks that tell a handle about a change, and what an ``_apply`` function would do.

Ownership: every module (and parameter) under an enabled handle is recorded here, so that enabling
offload on anything that contains, or is contained in, an offloaded model is refused with an error
naming the handle that owns it: two handles moving the same tensors would fight over them.

Changes: three process-wide torch hooks route to the owning handle, and cost a dictionary lookup
for every other module:

* module, parameter and buffer registration (a LoRA layer injected, a Parameter replaced, a block
  swapped): the owning part is marked ``dirty`` and re-packs before its next use (its
  ``reconcile``, in ``strategies/part.py``);
* ``nn.Module._apply``, behind ``.to()``, ``.half()``, ``.float()``, ``.cuda()``, ``.cpu()`` and
  the like: :func:`on_apply` decides before anything changes. torch has no hook for ``_apply``,
  so the method is wrapped once, process-wide, the first time offloading is enabled; modules no
  handle owns go straight to the original.

This module imports nothing of the library but its errors: the handle and the parts it calls
are reached through the registry, so every layer above may use it.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn
from torch.nn.modules import module as torch_module

from ..base.errors import AlreadyEnabledError, OffloadedModelError
from ..base.locks import locked

logger = logging.getLogger(__name__)

_lock = threading.Lock()
#: id(module) -> (weak module, weak handle, weak part): nothing here keeps a model alive, so a model
#: dropped without ``disable()`` is collected with its handle, and the handle's memory goes with it
_modules: dict[int, tuple[weakref.ref, weakref.ref, weakref.ref]] = {}
#: id(parameter) -> (weak parameter, weak handle)
_params: dict[int, tuple[weakref.ref, weakref.ref]] = {}
#: id(handle) -> the keys it registered
_keys: dict[int, tuple[list[int], list[int]]] = {}
#: id(handle) -> re-packs in progress: the hooks let the handle's own changes through meanwhile
_repacking: dict[int, int] = {}
_installed = False
_original_apply = nn.Module._apply


# -- ownership ------------------------------------------------------------------------------
def handle_of(module: nn.Module) -> tuple[Any, Any] | None:
    """(handle, part) that offload ``module``, or None."""
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
    locked(_lock, _register, handle, mods, params)


def _register(handle: Any, mods: list[int], params: list[int]) -> None:
    ref = weakref.ref(handle)
    _keys[id(handle)] = (mods, params)  # first: what an interrupted call recorded is found by unregister
    for part in handle.parts:
        if not part.enabled:
            continue
        for root in part.modules():
            for module in root.modules():
                mods.append(id(module))
                _modules[id(module)] = (weakref.ref(module), ref, weakref.ref(part))
            for p in root.parameters():
                params.append(id(p))
                _params[id(p)] = (weakref.ref(p), ref)


def unregister(handle: Any) -> None:
    locked(_lock, _unregister, handle)


def _unregister(handle: Any) -> None:
    mods, params = _keys.get(id(handle), ([], []))
    for key in mods:
        found = _modules.get(key)
        if found is not None and found[1]() in (handle, None):
            del _modules[key]
    for key in params:
        found = _params.get(key)
        if found is not None and found[1]() in (handle, None):
            del _params[key]
    _keys.pop(id(handle), None)  # last: an interrupted call leaves what it did not delete to the next


def check_free(modules: Iterable[nn.Module], what: str) -> None:
    """Raise if any of ``modules`` (or a module or parameter inside them) is already offloaded."""
    for root in modules:
        for name, module in root.named_modules():
            found = handle_of(module)
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


@contextlib.contextmanager
def repacking(handle: Any) -> Iterator[None]:
    """A part of ``handle`` packs itself again inside: the changes that makes (tensors bound,
    buffers registered, its own ``_apply``) pass the hooks. On exit, the modules and parameters
    the handle owns are recorded afresh (the re-pack may have changed them)."""
    key = id(handle)
    locked(_lock, _count_repack, key, 1)
    try:
        yield
    finally:
        locked(_lock, _count_repack, key, -1)
        unregister(handle)
        if handle.enabled:
            register(handle)


def _count_repack(key: int, step: int) -> None:
    """One more (``step`` 1) or one fewer (-1) re-pack of handle ``key`` in progress."""
    count = _repacking.get(key, 0) + step
    if count:
        _repacking[key] = count
    else:
        _repacking.pop(key, None)


def _is_repacking(handle: Any) -> bool:
    return id(handle) in _repacking


# -- hooks ----------------------------------------------------------------------------------
def install_hooks() -> None:
    locked(_lock, _install_hooks)


def _install_hooks() -> None:
    global _installed
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
    found = handle_of(module)
    if found is None:
        return None
    handle, part = found
    if _is_repacking(handle):
        return None
    if kind == "buffer" and name in module._buffers:
        return None
    part.dirty = True
    return None


def _apply(self: nn.Module, fn, recurse: bool = True):
    found = handle_of(self)
    if found is None:
        return _original_apply(self, fn, recurse)
    handle, part = found
    return on_apply(handle, part, self, fn, recurse)


# -- what an _apply function does -----------------------------------------------------------
def on_apply(handle: Any, part: Any, module: nn.Module, fn: Callable, recurse: bool) -> nn.Module:
    """``module._apply(fn)`` (``.to()``, ``.half()``, ...) on a module ``part`` of ``handle``
    offloads. Moving the weights to the backend's device is already true of an offloaded model:
    nothing to do. Moving them anywhere else is refused, before anything changes. A change of
    dtype, memory format or values re-packs the part around the change. Across ranks every
    change is refused."""
    return locked(handle.lock, _on_apply, handle, part, module, fn, recurse)


def _on_apply(handle: Any, part: Any, module: nn.Module, fn: Callable, recurse: bool) -> nn.Module:
    if _is_repacking(handle) or not part.enabled:
        return _original_apply(module, fn, recurse)
    if _method_of(fn) == "Module.share_memory":
        raise OffloadedModelError(
            f"{type(module).__name__}.share_memory(): while offloaded, its weights live in offload-core's host "
            "copies (pinned or pageable memory, or on disk) and its device slots, which other processes cannot "
            f"share. Call handle.disable() first ({handle!r}), then share_memory(), then enable offloading again"
        )
    tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
    device = handle.backend.device()
    action, where = classify(fn, tensors, device)
    if action == "none" and not is_conversion(fn):
        action = "change"  # it may work in place or depend on values: stand-ins cannot tell
    if action == "none":
        return module
    name = type(module).__name__
    if action == "move":
        raise OffloadedModelError(
            f"{name}: this would move offloaded weights to {where}; while offloading is on, offload-core "
            f"keeps them on {device} and in host memory. Call handle.disable() first ({handle!r}), then move "
            "the model"
        )
    if part.repack_refusal() is not None:
        raise OffloadedModelError(
            f"{name}: changing the dtype or values of a model offloaded across ranks is not supported; call "
            f"the collective handle.disable() on every rank first ({handle!r})"
        )
    logger.info("%s changes dtype or layout while offloaded: packing it again", name)
    part.repack(lambda: _original_apply(module, keep_placement(fn), recurse))
    return module


#: the ``nn.Module`` methods whose ``_apply`` function is a conversion: a new tensor (or the input
#: itself) made from the input's device, dtype and layout alone, so that stand-ins tell what it does
CONVERSIONS = frozenset(
    ("to", "half", "float", "double", "bfloat16", "cuda", "cpu", "type", "xpu", "ipu", "mtia", "to_empty")
)


def is_conversion(fn: Callable) -> bool:
    """True for torch's own conversions (``.to()``, ``.half()``, ``.cuda()`` ...). Any other
    ``_apply`` function (``lambda t: t.mul_(2)``, a library's own) may write in
    place or depend on the values, which stand-ins cannot show: it goes through a re-pack."""
    method = _method_of(fn)
    return method.startswith("Module.") and method[len("Module."):] in CONVERSIONS


def _method_of(fn: Callable) -> str:
    """The ``nn.Module`` method ``fn`` was made in ("Module.to"), or "" for any other function."""
    if getattr(fn, "__module__", None) != nn.Module.__module__:
        return ""
    return getattr(fn, "__qualname__", "").split(".<locals>.")[0]


def classify(fn: Callable, tensors: list[torch.Tensor], device: torch.device) -> tuple[str, Any]:
    """What ``fn`` (an ``_apply`` function) would do to ``tensors``, tried on small stand-ins of
    each (device, dtype): ``("none", None)``, ``("move", device)`` to a device other than the
    backend's, or ``("change", None)`` (dtype, memory format or values)."""
    kinds = {(t.device, t.dtype, t.dim() >= 4) for t in tensors}
    change = False
    for where, dtype, four_d in kinds:
        probes = [torch.empty(0, dtype=dtype, device=where)]
        if four_d:
            probes.append(torch.empty((1, 2, 2, 2), dtype=dtype, device=where))
        for probe in probes:
            try:
                out = fn(probe)
            except Exception:  # noqa: BLE001 - not a conversion we can read: re-pack around it
                return "change", None
            if out is probe:
                continue
            if not isinstance(out, torch.Tensor):
                return "change", None
            if out.device != probe.device:
                if out.device != device:
                    return "move", out.device
                if out.dtype == dtype and out.stride() == probe.stride():
                    continue  # onto the backend's device: where an offloaded model already is
            change = True
    return ("change", None) if change else ("none", None)


def keep_placement(fn: Callable) -> Callable:
    """``fn`` without its device move: each result stays where its input was."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        return out.to(t.device) if isinstance(out, torch.Tensor) and out.device != t.device else out

    return apply
