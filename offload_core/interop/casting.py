"""diffusers' layerwise casting on an offloaded model: weights stored narrow (float8), computed wide.

``enable_layerwise_casting(storage_dtype, compute_dtype)`` stores each cast layer's weights in the
storage dtype and, around the layer's forward, casts them to the compute dtype and back
(``module.to(dtype=...)`` in a ``LayerwiseCastingHook``). Offloading packs what the model holds,
so the host homes, every copy to the device and the slots hold the narrow weights; the cast to
the compute dtype is the layer's own, on the device, just before it computes.

Left alone, the hook's casts would fight offloading: each ``module.to()`` is an ``_apply``
(changes.py: a re-pack), and the cast back makes new tensors, which a block going home would see as
weights given new data (copied home). So while a model is offloaded each casting hook's pre- and
post-forward are taken over (:class:`CastingHooks`, an install of the handle): before the layer's
forward its weights show a compute-dtype copy made from what they show (the device view), after it
they show that very view again. The cast back of diffusers is exact (every storage value is a
compute value: :func:`exact_round_trip`), so restoring the view is what it computes, without a
write and without a new tensor. ``disable()`` gives the hooks back, and the model is as diffusers'
casting left it: weights in the storage dtype, hooks in place.

Casting attached after ``enable_offload``: the method (``enable_layerwise_casting``) runs on the
ordinary model inside one re-pack of the part that owns it (across ranks, a collective one, as
``handle.disable()`` is); the functional ``apply_layerwise_casting`` changes one layer's dtype at a
time, each an ``_apply`` that re-packs as any dtype change does, and each hook is taken over as
diffusers registers it (other_hooks.py guards ``HookRegistry.register_hook``).

``storage_dtype=`` (:func:`cast_for_storage`) is that casting applied by the library to the DiTs,
with diffusers' default skip patterns and the weights' dtype as the compute dtype.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Iterable, Iterator

import torch
from torch import nn

from ..common import changes
from ..base.errors import OffloadConfigError, OffloadedModelError
from ..strategies.distributed import agreement
from ..weights.binding import CAST_COPIES

#: the name diffusers registers its casting hook under (``HookRegistry.hooks``)
CASTING_HOOK = "layerwise_casting"
#: the diffusers model method that attaches it
CASTING_METHOD = "enable_layerwise_casting"


def casting_hooks(roots: Iterable[nn.Module]) -> Iterator[tuple[nn.Module, Any]]:
    """(module, its ``LayerwiseCastingHook``) under ``roots``."""
    seen: set[int] = set()
    for root in roots:
        for module in root.modules():
            registry = getattr(module, "_diffusers_hook", None)
            hook = getattr(registry, "hooks", {}).get(CASTING_HOOK) if registry is not None else None
            if hook is not None and id(module) not in seen:
                seen.add(id(module))
                yield module, hook


def exact_round_trip(storage: torch.dtype, compute: torch.dtype) -> bool:
    """Whether every ``storage`` value is a ``compute`` value, so that casting to ``compute`` and
    back gives the stored weights back: as many mantissa bits or more, a range as wide or wider,
    and the storage's smallest subnormal a compute value."""
    if storage == compute:
        return True
    if not (storage.is_floating_point and compute.is_floating_point):
        return False
    s, c = torch.finfo(storage), torch.finfo(compute)
    return c.eps <= s.eps and c.max >= s.max and c.smallest_normal * c.eps <= s.smallest_normal * s.eps


def _training_refused(param: nn.Parameter, storage: torch.dtype, *grad) -> None:
    raise OffloadedModelError(
        f"a gradient reached a weight stored in {str(storage).removeprefix('torch.')} by diffusers' layerwise casting "
        f"(shape {list(param.shape)}): full fine-tuning of a weight stored narrow is not supported (it would be "
        "updated and stored in the storage dtype). Freeze the cast weights (model.requires_grad_(False)) and train an "
        "adapter (a peft LoRA, which casting skips), or load the model without layerwise casting / storage_dtype"
    )


class _Casts:
    """The pre- and post-forward that replace one ``LayerwiseCastingHook``'s while offloaded."""

    __slots__ = ("hook", "saved", "copies", "refusals")

    def __init__(self, hook: Any) -> None:
        self.hook = hook
        self.saved: list = []  # what the layer's tensors showed before its forward
        self.copies: list[int] = []  # its entries in CAST_COPIES (a forward that raised leaves them)
        self.refusals: dict[int, Any] = {}  # id(param) -> its gradient hook refusing training

    def pre(self, module: nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        """As diffusers' ``module.to(dtype=compute_dtype)`` (floating and complex tensors of the
        module and its children), without ``_apply``: each tensor given a compute-dtype copy of
        what it shows, the shown tensor kept for :meth:`post`."""
        dtype, non_blocking = self.hook.compute_dtype, self.hook.non_blocking
        grad = torch.is_grad_enabled()
        self._forget_copies()
        saved = []
        for m in module.modules():
            for p in m._parameters.values():
                if p is None or p.dtype == dtype or not (p.is_floating_point() or p.is_complex()):
                    continue
                if grad and p.requires_grad and id(p) not in self.refusals:
                    self.refusals[id(p)] = p.register_hook(
                        functools.partial(_training_refused, p, self.hook.storage_dtype))
                data = p.data
                saved.append((p, data))
                p.data = copy = data.to(dtype, non_blocking=non_blocking)
                if grad and copy.numel():  # saved for backward: as the weight it came from
                    self.copies.append(copy.untyped_storage().data_ptr())
                    CAST_COPIES[self.copies[-1]] = (copy, data)
            for name, b in m._buffers.items():
                if b is None or b.dtype == dtype or not (b.is_floating_point() or b.is_complex()):
                    continue
                saved.append((m, name, b))
                m._buffers[name] = b.to(dtype, non_blocking=non_blocking)
        self.saved = saved
        return args, kwargs

    def post(self, module: nn.Module, output: Any) -> Any:
        """As diffusers' cast back to the storage dtype: each tensor shows again what it showed
        before the forward (the cast back of a compute-dtype copy of it gives it exactly)."""
        saved, self.saved = self.saved, []
        self._forget_copies()
        for entry in saved:
            if len(entry) == 2:
                entry[0].data = entry[1]
            else:
                entry[0]._buffers[entry[1]] = entry[2]
        return output

    def _forget_copies(self) -> None:
        while self.copies:
            CAST_COPIES.pop(self.copies.pop(), None)

    def release(self) -> None:
        self._forget_copies()
        while self.refusals:
            self.refusals.popitem()[1].remove()


def _taken(hook: Any) -> _Casts | None:
    casts = getattr(hook.fn_ref.pre_forward, "__self__", None)
    return casts if isinstance(casts, _Casts) else None


def take_over(hook: Any) -> None:
    """Make ``hook``'s casts the offload-safe ones (see the module docstring); idempotent."""
    if _taken(hook) is None:
        casts = _Casts(hook)
        hook.fn_ref.pre_forward, hook.fn_ref.post_forward = casts.pre, casts.post


def give_back(hook: Any) -> None:
    """``hook`` casts as diffusers does again."""
    casts = _taken(hook)
    if casts is not None:
        casts.release()
        hook.fn_ref.pre_forward, hook.fn_ref.post_forward = hook.pre_forward, hook.post_forward


def check_casting(roots: Iterable[nn.Module], parts: Iterable[Any]) -> None:
    """Before anything moves: the casting on ``roots`` is one offloading can run exactly (see
    :func:`check_hook`)."""
    parts = list(parts)
    for module, hook in casting_hooks(roots):
        check_hook(module, hook, parts)


def check_hook(module: nn.Module, hook: Any, parts: Iterable[Any]) -> None:
    """A casting ``hook`` on ``module`` that offloading cannot run exactly is refused
    (``OffloadConfigError``, before it changes anything): a compute dtype that cannot hold every
    storage value (diffusers' cast back then changes the stored weights on every call), and a hook
    on a module holding streamed blocks of ``parts`` (its cast would take every block at once;
    diffusers casts layer by layer unless told otherwise)."""
    _check_pair(hook.storage_dtype, hook.compute_dtype, type(module).__name__)
    streamed = {id(b) for part in parts for b in getattr(part, "blocks", ())}
    inner = [m for m in module.modules() if id(m) in streamed and m is not module]
    if inner:
        raise OffloadConfigError(
            f"layerwise casting is attached to {type(module).__name__} as a whole, which holds the streamed "
            f"block {type(inner[0]).__name__}: its cast would take every block at once. Cast layer by layer "
            "(model.enable_layerwise_casting(), or apply_layerwise_casting with skip_modules_pattern='auto')"
        )


def _check_pair(storage: torch.dtype, compute: torch.dtype, where: str) -> None:
    if not exact_round_trip(storage, compute):
        raise OffloadConfigError(
            f"layerwise casting of {where} stores {storage} and computes in {compute}, which cannot hold every "
            f"{storage} value: diffusers' cast back then changes the stored weights on every call, which offloading "
            "cannot reproduce. Use a compute dtype wider than the storage dtype (float8 storage, bfloat16 compute)"
        )


class CastingHooks:
    """The install (see ``handle.Install``) that takes over the casting hooks under the target's
    roots and makes each root's ``enable_layerwise_casting`` run inside a re-pack; ``uninstall``
    gives both back."""

    def __init__(self, roots: list[nn.Module], handle: Any) -> None:
        self.roots = roots
        self.handle = handle
        self._shadowed: list[tuple[nn.Module, Callable]] = []

    def install(self) -> None:
        for _, hook in casting_hooks(self.roots):
            take_over(hook)
        if self._shadowed:
            return
        for root in self.roots:
            if CASTING_METHOD in root.__dict__ or not callable(getattr(type(root), CASTING_METHOD, None)):
                continue
            method = functools.partial(self._cast_after_enable, root)
            root.__dict__[CASTING_METHOD] = method
            self._shadowed.append((root, method))

    def uninstall(self) -> None:
        while self._shadowed:
            root, method = self._shadowed.pop()
            if root.__dict__.get(CASTING_METHOD) is method:
                del root.__dict__[CASTING_METHOD]
        for _, hook in casting_hooks(self.roots):
            give_back(hook)

    def _cast_after_enable(self, root: nn.Module, *args: Any, **kwargs: Any) -> None:
        """``root.enable_layerwise_casting(...)`` on an offloaded model: diffusers' method on the
        ordinary model, inside one re-pack of the part that owns ``root`` (collective across ranks:
        every rank calls it, as every rank calls ``handle.disable()``); then its hooks are taken over."""
        original = getattr(type(root), CASTING_METHOD)
        bound = inspect.signature(original).bind(root, *args, **kwargs)
        bound.apply_defaults()
        compute = bound.arguments["compute_dtype"] or root.dtype
        _check_pair(bound.arguments["storage_dtype"], compute, type(root).__name__)
        found = changes.handle_of(root)
        with self.handle.lock:
            if found is None or not found[1].enabled:  # no weights offloaded here: nothing to pack again
                original(*bound.args, **bound.kwargs)
            else:
                repack(self.handle, found[1], lambda: original(*bound.args, **bound.kwargs))
            for _, hook in casting_hooks([root]):
                take_over(hook)


def repack(handle: Any, part: Any, apply: Callable[[], None]) -> None:
    """``part.repack(apply)``; a part offloaded across ranks re-packs on every rank at once, its
    enable ending with the ranks' agreement as ``enable_offload``'s does."""
    if part.repack_refusal() is None:
        part.repack(apply)
        return
    with agreement(handle.config) as agreed:
        agreed.parts = [part]
        part.repack(apply, collective=True)


# -- storage_dtype= ------------------------------------------------------------------------------
def weights_dtype(module: nn.Module) -> torch.dtype | None:
    """The dtype a model computes in: diffusers' ``ModelMixin.dtype`` (its weights' dtype, modules
    kept in float32 aside), else that of its first floating parameter."""
    dtype = getattr(module, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    return next((p.dtype for p in module.parameters() if p.is_floating_point()), None)


def cast_for_storage(dits: list[tuple[str, nn.Module]], storage: torch.dtype) -> None:
    """``storage_dtype=``: diffusers' layerwise casting of each DiT, stored in ``storage`` and
    computed in its weights' dtype, with diffusers' default skip patterns (the model's method adds
    the model's own and peft's adapter layers, as it does for a user). Every DiT is checked before
    any is cast: a storage dtype no narrower than the weights, or a DiT cast already, is an
    ``OffloadConfigError`` that leaves the model untouched. Works on models built on the meta
    device with their checkpoint slices attached (``from_pretrained``): the parameters keep their
    slice, which packing then reads into a narrow home, converting on the way."""
    pairs = []
    for name, module in dits:
        compute = weights_dtype(module)
        if compute is None:
            continue
        if storage.itemsize >= compute.itemsize or not exact_round_trip(storage, compute):
            raise OffloadConfigError(
                f"storage_dtype={storage} must be a floating dtype narrower than the weights it stores; {name} is "
                f"in {compute}"
            )
        if next(casting_hooks([module]), None) is not None:
            raise OffloadConfigError(
                f"storage_dtype={storage}: {name} has diffusers' layerwise casting already; drop storage_dtype=, "
                "the casting it has is streamed narrow as it is"
            )
        pairs.append((module, compute))
    for module, compute in pairs:
        if callable(getattr(module, CASTING_METHOD, None)):
            getattr(module, CASTING_METHOD)(storage_dtype=storage, compute_dtype=compute)
        else:
            from diffusers.hooks import apply_layerwise_casting

            apply_layerwise_casting(module, storage, compute, skip_modules_pattern="auto")
