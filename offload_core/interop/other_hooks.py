"""Other libraries' hooks on a model: which ones offload runs under, and which it refuses.

Hooks that manage the weights' placement themselves cannot share a model with offloading: they
move the very tensors offloading binds to its buffers. accelerate's hooks and diffusers' group
offloading do. diffusers' layerwise casting changes the weights' dtype around each layer's
forward: offloading streams the narrow weights and takes its casts over (casting.py), from the
moment the hook is registered on a module an enabled handle owns. Everything else diffusers
attaches to a model (its caches such as the first-block cache, guidance hooks) only changes what
the forward computes, and runs on top of offload unchanged, whether it was attached before or
after ``enable_offload``: the offload work happens around each module call, outside the forward
those hooks wrap. docs/compatibility.md lists what is tested.

:func:`refused_hook` is the rule. It is applied at ``enable_offload`` (:func:`weight_hooks`: a hook
attached already), and where each library attaches a hook (:func:`guard_registrations`:
diffusers' ``HookRegistry.register_hook``, behind ``apply_group_offloading`` and the model method
``enable_group_offload()``, and behind layerwise casting too, which it takes over;
accelerate's ``add_hook_to_module``, behind ``cpu_offload`` and ``dispatch_model``): a refused hook
on a module an enabled handle owns raises before the hook's initialisation touches a weight, so
the model stays as it was and usable.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any, Callable, Iterable

from torch import nn

from ..common import changes
from .casting import CASTING_HOOK, check_hook, take_over
from ..base.errors import OffloadConfigError
from ..base.locks import locked

_GROUP = "diffusers' group offloading (it moves the weights between devices)"

#: diffusers hooks, by their ``HookRegistry`` name, that offload refuses, and what to call them
REFUSED_DIFFUSERS_HOOKS = {
    "group_offloading": _GROUP,
    "layer_execution_tracker": _GROUP,
    "lazy_prefetch_group_offloading": _GROUP,
}
#: every accelerate hook (``_hf_hook``) is refused: its hooks move weights and inputs between devices
ACCELERATE = "accelerate's hooks (cpu_offload, dispatch_model, add_hook_to_module: they move the weights between devices)"


def refused_hook(library: str, name: str = "") -> str | None:
    """The rule: what to call a hook of ``library`` ("diffusers", with its ``HookRegistry`` name
    ``name``; "accelerate") that offload refuses on a model it streams, or None for a hook that
    runs on top of offload."""
    if library == "accelerate":
        return ACCELERATE
    return REFUSED_DIFFUSERS_HOOKS.get(name)


def weight_hooks(roots: Iterable[nn.Module]) -> str | None:
    """What, among the hooks on ``roots`` and their submodules, offload refuses; None if nothing."""
    for root in roots:
        for module in root.modules():
            if getattr(module, "_hf_hook", None) is not None:
                return refused_hook("accelerate")
            registry = getattr(module, "_diffusers_hook", None)
            for name in getattr(registry, "hooks", None) or ():
                refused = refused_hook("diffusers", name)
                if refused is not None:
                    return refused
    return None


def _refuse_on_offloaded(module: Any, what: str, how: str) -> None:
    """Raise if an enabled handle owns ``module``, to which ``how`` attaches ``what``."""
    found = changes.handle_of(module) if isinstance(module, nn.Module) else None
    if found is not None:
        raise OffloadConfigError(
            f"{how} attaches {what} to {type(module).__name__}, whose weights offload-core streams ({found[0]!r}); "
            "use one or the other: call handle.disable() first. Nothing was changed"
        )


def _guard_diffusers(hooks_module: Any) -> None:
    """diffusers attaches every hook through ``HookRegistry.register_hook``, which initialises the
    hook (layerwise casting casts the module there) before anything else."""
    registry = hooks_module.HookRegistry
    original = registry.register_hook
    if getattr(original, "_offload_core_guard", False):
        return

    @functools.wraps(original)
    def register_hook(self, hook, name, *args, **kwargs):
        module = getattr(self, "_module_ref", None)
        refused = refused_hook("diffusers", name)
        if refused is not None:
            _refuse_on_offloaded(module, refused, f"{type(hook).__name__} ({name!r})")
        owner = changes.handle_of(module) if name == CASTING_HOOK and isinstance(module, nn.Module) else None
        if owner is not None:  # casting after enable (the function): its initialisation re-packs, a dtype change
            check_hook(module, hook, [p for p in owner[0].parts if p.enabled])
        registered = original(self, hook, name, *args, **kwargs)
        if owner is not None:
            take_over(hook)
        return registered

    register_hook._offload_core_guard = True
    registry.register_hook = register_hook


def _guard_accelerate(hooks_module: Any) -> None:
    """accelerate attaches every hook through ``add_hook_to_module``, which initialises it (moving
    weights to the meta device or another device) before anything else. Modules that imported the
    function by name (``accelerate.big_modeling``) are given the guarded one too."""
    original = hooks_module.add_hook_to_module
    if getattr(original, "_offload_core_guard", False):
        return

    @functools.wraps(original)
    def add_hook_to_module(module, hook, *args, **kwargs):
        _refuse_on_offloaded(module, refused_hook("accelerate"), f"accelerate's {type(hook).__name__}")
        return original(module, hook, *args, **kwargs)

    add_hook_to_module._offload_core_guard = True
    for loaded in list(sys.modules.values()):
        namespace = getattr(loaded, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("add_hook_to_module") is original:
            namespace["add_hook_to_module"] = add_hook_to_module


#: the module that defines each library's registration point, and how to guard it
_GUARDS: dict[str, Callable[[Any], None]] = {
    "diffusers.hooks.hooks": _guard_diffusers,
    "accelerate.hooks": _guard_accelerate,
}
_lock = threading.Lock()


class _GuardOnImport(importlib.abc.MetaPathFinder):
    """Guards a registration point whose module is imported after offloading was first enabled
    (a plain torch model offloaded, diffusers imported later): importing diffusers' hooks costs
    seconds, which enabling a model that does not use them should not. Answers for those modules
    only, with the spec the path finder gives, whose loader guards the module once it ran."""

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        guard = _GUARDS.get(fullname)
        if guard is None or fullname in sys.modules:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            guard(module)

        loader.exec_module = exec_module  # this spec's own loader: the path finder makes one per module
        return spec


_finder = _GuardOnImport()


def guard_registrations() -> None:
    """Guard the libraries' registration points (once, process-wide, when offloading is first
    enabled): those imported already now, the others as they are imported. A guard costs one
    dictionary lookup per hook attached to a module no handle owns."""
    locked(_lock, _guard_registrations)


def _guard_registrations() -> None:
    for name, guard in _GUARDS.items():
        module = sys.modules.get(name)
        if module is not None:
            guard(module)
    if _finder not in sys.meta_path and not all(name in sys.modules for name in _GUARDS):
        sys.meta_path.insert(0, _finder)
