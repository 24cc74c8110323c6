"""Tensor subclasses in weight units: how quantized weights are streamed like any other.

Quantized weights are tensor subclasses of two kinds, and both are streamed through the unit's
per-dtype buffers, so a block still moves in one copy per dtype:

* **Storage subclasses** (diffusers' ``GGUFParameter``, made with ``Tensor._make_subclass``) own
  ordinary storage: it is packed like a plain tensor's, and rebinding keeps the owner's class and
  attributes (``quant_type``).
* **Wrapper subclasses** with ``__tensor_flatten__`` / ``__tensor_unflatten__`` (torchao's
  ``Int8Tensor`` and ``AffineQuantizedTensor``, optimum-quanto's ``QBytesTensor``) own no storage:
  their inner tensors (int8 data, scales), found recursively through ``__tensor_flatten__``, are
  packed as plain tensors, and binding rebuilds the subclass around views of the buffers.

Anything else (a wrapper without ``__tensor_flatten__``, or one whose parts are neither plain nor
flattenable) cannot be streamed: :class:`Unstreamable` says why, and the unit keeps it on the device.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Sequence

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ..base.errors import Unstreamable
from .placeholders import PlaceholderParameter, PlaceholderTensor, shows_placeholder


logger = logging.getLogger(__name__)


_PLAIN = (torch.Tensor, nn.Parameter, PlaceholderTensor, PlaceholderParameter)


def is_plain(t: torch.Tensor) -> bool:
    return type(t) in _PLAIN


def has_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` owns ordinary storage (plain tensors, meta ones included, and
    ``_make_subclass`` subclasses); wrapper subclasses have none."""
    if is_plain(t):
        return True
    if is_traceable_wrapper_subclass(t):
        return False
    try:
        with torch._C.DisableTorchFunctionSubclass():
            t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def plain_alias(t: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.Tensor`` viewing ``t``'s storage, so that packing reads it without going
    through the subclass's ``__torch_function__`` (GGUFParameter re-wraps every result)."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach()


@dataclasses.dataclass
class Flat:
    """A wrapper subclass taken apart: its plain leaf tensors, and how to rebuild it from views
    laid out like them."""

    leaves: list[torch.Tensor]
    rebuild: Callable[[Sequence[torch.Tensor]], torch.Tensor]


def flatten(t: torch.Tensor, where: str) -> Flat:
    """The plain tensors inside the wrapper subclass ``t``, found through ``__tensor_flatten__``
    (recursively), and a function rebuilding ``t``'s type and metadata around replacements.
    Raises :class:`Unstreamable` when a part is neither plain nor flattenable, or the rebuild fails."""
    if not is_traceable_wrapper_subclass(t):
        raise Unstreamable(f"{where} is a {type(t).__name__} without __tensor_flatten__")
    names, ctx = t.__tensor_flatten__()
    parts: list[tuple[str, Flat | None]] = []
    leaves: list[torch.Tensor] = []
    for name in names:
        inner = getattr(t, name)
        if is_traceable_wrapper_subclass(inner):
            sub = flatten(inner, f"{where}.{name}")
            parts.append((name, sub))
            leaves.extend(sub.leaves)
        elif has_storage(inner) and type(inner) is torch.Tensor and inner.layout == torch.strided and not inner.is_meta:
            parts.append((name, None))
            leaves.append(inner)
        else:
            raise Unstreamable(f"{where}.{name} is a {type(inner).__name__} ({inner.layout}) that cannot be packed")
    cls, size, stride = type(t), t.size(), t.stride()

    def rebuild(views: Sequence[torch.Tensor]) -> torch.Tensor:
        inner, k = {}, 0
        for name, sub in parts:
            if sub is None:
                inner[name], k = views[k], k + 1
            else:
                n = len(sub.leaves)
                inner[name], k = sub.rebuild(views[k : k + n]), k + n
        return cls.__tensor_unflatten__(inner, ctx, size, stride)

    try:
        rebuilt = rebuild(leaves)
    except Exception as exc:  # noqa: BLE001 - any failure means: do not stream it
        raise Unstreamable(f"{where}: {cls.__name__}.__tensor_unflatten__ failed ({exc})") from None
    if type(rebuilt) is not cls or rebuilt.shape != t.shape or rebuilt.dtype != t.dtype:
        raise Unstreamable(f"{where}: {cls.__name__}.__tensor_unflatten__ does not rebuild a {cls.__name__} like it")
    return Flat(leaves, rebuild)


def inner_names(t: torch.Tensor) -> list[str]:
    return list(t.__tensor_flatten__()[0])


def assign_param(param: torch.Tensor, tensor: torch.Tensor) -> None:
    """Point the parameter ``param`` at ``tensor``'s data, keeping the parameter object (its
    identity, class, attributes and ``requires_grad``).

    Plain and storage-subclass parameters take ``.data``. A wrapper subclass cannot: ``.data =``
    replaces only the outer shell and its kernels would keep reading the old inner tensors. So
    its inner tensors are set in place when ``tensor`` is the same type on the same device, and
    the two objects' contents are swapped (``torch.utils.swap_tensors``) when the device changes,
    so that ``param.device`` tells the truth.
    """
    if not is_traceable_wrapper_subclass(param):
        param.data = tensor
        shows_placeholder(param, tensor)
        return
    if type(tensor) is type(param) and tensor.device == param.device:
        for name in inner_names(tensor):
            setattr(param, name, getattr(tensor, name))
        return
    for key, value in param.__dict__.items():  # Parameter flag, user attributes: they stay with param
        tensor.__dict__.setdefault(key, value)
    try:
        torch.utils.swap_tensors(param, tensor)
    except RuntimeError as exc:
        raise RuntimeError(
            f"cannot move the {type(param).__name__} parameter to {tensor.device}: {exc}; "
            "something else holds a reference to it"
        ) from exc


def like(current: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as the class of the buffer it replaces (a storage subclass keeps its class and
    attributes; plain and wrapper tensors are taken as they are)."""
    if is_plain(current) or type(tensor) is type(current) or not has_storage(current):
        return tensor
    out = tensor.as_subclass(type(current))
    out.__dict__.update(current.__dict__)
    return out
