"""Other libraries' hooks on a model: which ones offload runs under, and which it refuses.

Hooks that manage the weights' placement themselves cannot share a model with offloading: they move
the very tensors offloading binds to its buffers. accelerate's offload hooks and diffusers' group
offloading do. diffusers' layerwise casting changes the weights' dtype around each layer's forward:
offloading streams the narrow weights and takes its casts over (casting.py). Everything else
diffusers attaches to a model (its caches such as the first-block cache, guidance hooks) only
changes what the forward computes, and runs on top of offload unchanged, whether it was attached
before or after ``enable_offload``: the offload work happens around each module call, outside the
forward those hooks wrap. docs/compatibility.md lists what is tested.

Placement-managing hooks are refused at ``enable_offload``; diffusers' method that attaches them
(``enable_group_offload``) is refused on an offloaded model too.
"""

from __future__ import annotations

from typing import Callable, Iterable

from torch import nn
from .errors import OffloadConfigError


#: diffusers hook names (``HookRegistry`` keys) that manage the weights' placement, and what to call them
DIFFUSERS_WEIGHT_HOOKS = {
    "group_offloading": "diffusers' group offloading",
    "layer_execution_tracker": "diffusers' group offloading",
    "lazy_prefetch_group_offloading": "diffusers' group offloading",
}


def weight_hooks(roots: Iterable[nn.Module]) -> str | None:
    """What, among the hooks on ``roots`` and their submodules, manages the weights; None if nothing."""
    for root in roots:
        for module in root.modules():
            if getattr(module, "_hf_hook", None) is not None:
                return "accelerate's offload hooks"
            registry = getattr(module, "_diffusers_hook", None)
            for name in getattr(registry, "hooks", None) or ():
                if name in DIFFUSERS_WEIGHT_HOOKS:
                    return DIFFUSERS_WEIGHT_HOOKS[name]
    return None


#: diffusers model methods that attach placement-managing hooks
WEIGHT_HOOK_METHODS = ("enable_group_offload",)


def refuse_weight_hook_methods(roots: Iterable[nn.Module]) -> Callable[[], None]:
    """Make the roots' :data:`WEIGHT_HOOK_METHODS` raise while offloading is enabled (they would
    move the weights offloading streams); returns the undo."""
    shadowed = []
    for root in roots:
        for name in WEIGHT_HOOK_METHODS:
            if name in root.__dict__ or not callable(getattr(type(root), name, None)):
                continue

            def refuse(*args, _name=name, _model=type(root).__name__, **kwargs):
                raise OffloadConfigError(
                    f"{_model}.{_name}() attaches hooks that manage the weights offloading streams; "
                    "call handle.disable() first"
                )

            root.__dict__[name] = refuse
            shadowed.append((root, name, refuse))

    def undo() -> None:
        for root, name, fn in shadowed:
            if root.__dict__.get(name) is fn:
                del root.__dict__[name]

    return undo
