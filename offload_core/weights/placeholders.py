"""Placeholders: what the tensors of a block with no home in RAM (its home on disk, or only a
shard of it on this rank) show outside the block's forward.

A placeholder has the shape and dtype of its tensor, and every element is the poison of its dtype
(NaN; integers: their maximum; booleans: True; every bit set for the dtypes without arithmetic,
bits and packed 4-bit floats) through one element of memory (all strides 0), so a
block on disk costs no RAM at rest. Computing with one gives NaN on a CPU and a device-mismatch
error on an accelerator, never another block's weights.

A write into one has nowhere to go. Buffers show a :class:`PlaceholderTensor` and parameters are a
:class:`PlaceholderParameter` while they show one (the class is swapped back when the block is
bound to its slot or given its values again): their ``__torch_function__`` refuses in-place and
``out=`` operations, ``.data``'s too, with :class:`OffloadedModelError`, before anything is
written. A write that goes around them (through ``detach()``, a storage, numpy) lands in the
shared element: :func:`check_placeholders` finds it where the block is next used, puts the poison
back and raises the same error.
"""

from __future__ import annotations

import functools
from typing import Iterable

import torch
from torch import nn

from ..base.errors import OffloadedModelError

_REFUSAL = (
    "has no home in RAM (its home on disk, or a shard on each rank): a write into its tensors outside "
    "its forward (mul_(), copy_(), zero_(), nn.init, out=) has nowhere to go"
)
_FIX = "Call handle.disable() first (on every rank, when distributed), or give it RAM"
#: in-place by name but changing no element
_METADATA = frozenset({"requires_grad_", "share_memory_", "set_", "detach_", "retain_grad"})
#: in-place operators torch does not name after an in-place method (``p += 1`` is ``add_``)
_WRITING_DUNDERS = frozenset({"__setitem__", "__ior__", "__iand__", "__ixor__", "__ilshift__", "__irshift__"})
_DATA = torch.Tensor.data


def poison(dtype: torch.dtype) -> float | int | bool:
    """What every element of a placeholder of ``dtype`` holds (a dtype without arithmetic, see
    :func:`_fills`, has every bit set instead)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    return True if dtype == torch.bool else torch.iinfo(dtype).max


@functools.cache
def _fills(dtype: torch.dtype) -> bool:
    """Whether tensors of ``dtype`` can be filled with its poison: not the bits dtypes nor the
    packed 4-bit floats, which have no arithmetic."""
    try:
        torch.empty(1, dtype=dtype).fill_(poison(dtype))
    except (TypeError, RuntimeError):
        return False
    return True


def _fill_poison(t: torch.Tensor) -> None:
    if _fills(t.dtype):
        t.fill_(poison(t.dtype))
    else:
        t.reshape(-1).view(torch.uint8).fill_(0xFF)


def placeholders(unit) -> list[torch.Tensor]:
    """A placeholder for each of ``unit``'s entries (its owners are bound to them). The parts of
    a quantized weight (entries without owners) stay plain tensors: their wrapper is rebuilt
    around them, and its own dispatch decides what a write does."""
    shared = {dtype: torch.empty((), dtype=dtype) for dtype in unit.numel}
    for element in shared.values():
        _fill_poison(element)
    views = [shared[e.dtype].expand(e.size) for e in unit.entries]
    return [v.as_subclass(PlaceholderTensor) if e.owners else v for e, v in zip(unit.entries, views)]


def _refuses(func, args, kwargs) -> bool:
    """Whether ``func(*args, **kwargs)`` writes into a placeholder among its arguments."""
    name = getattr(func, "__name__", "")
    first = args[0] if args else next(iter(kwargs.values()), None)  # nn.init passes ``tensor=``
    if (name.endswith("_") and not name.endswith("__") and name not in _METADATA) or name in _WRITING_DUNDERS \
            or kwargs.get("inplace") is True:
        return isinstance(first, _KINDS)
    out = kwargs.get("out")
    return any(isinstance(o, _KINDS) for o in (out if isinstance(out, (tuple, list)) else (out,)))


def _torch_function(func, args, kwargs):
    kwargs = kwargs or {}
    if _refuses(func, args, kwargs):
        raise OffloadedModelError(f"this tensor's block {_REFUSAL}. {_FIX}")
    with torch._C.DisableTorchFunctionSubclass():  # results are ordinary tensors
        result = func(*args, **kwargs)
    name, of_data = getattr(func, "__name__", ""), getattr(func, "__self__", None) is _DATA
    if of_data and name == "__get__":  # ``p.data``: the same memory, refusing writes too
        return result.as_subclass(PlaceholderTensor)
    if ((of_data and name == "__set__") or name == "set_") and type(args[0]) is PlaceholderParameter:
        args[0].__class__ = nn.Parameter  # ``p.data = t``, ``p.set_(t)``: the user's tensor, the truth
    return result


class PlaceholderTensor(torch.Tensor):
    """A placeholder (see the module docstring): computing with it works, writing into it raises."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs)

    def __deepcopy__(self, memo):  # copies and saves are ordinary tensors
        return memo.setdefault(id(self), _plain(self).clone())

    def __reduce_ex__(self, protocol):
        return _plain(self).__reduce_ex__(protocol)


class PlaceholderParameter(nn.Parameter):
    """The class of a parameter while it shows a placeholder (``isinstance(p, nn.Parameter)``
    stays true); it is an ``nn.Parameter`` again as soon as it shows real values."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs)

    def __deepcopy__(self, memo):
        return memo.setdefault(id(self), nn.Parameter(_plain(self).clone(), self.requires_grad))


_KINDS = (PlaceholderTensor, PlaceholderParameter)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """An ordinary tensor viewing the placeholder ``t``."""
    with torch._C.DisableTorchFunctionSubclass():
        return t.detach().as_subclass(torch.Tensor)


def swaps_class(param: nn.Parameter) -> bool:
    """Whether ``param``'s class says if it shows a placeholder: a parameter of another class
    (a quantized one) keeps its own."""
    return type(param) in (nn.Parameter, PlaceholderParameter)


def shows_placeholder(param: nn.Parameter, view: torch.Tensor) -> None:
    """Give ``param`` (just pointed at ``view``) the class that says whether it shows a
    placeholder (see ``swaps_class``)."""
    if swaps_class(param):
        param.__class__ = PlaceholderParameter if type(view) is PlaceholderTensor else nn.Parameter


def parameter(view: torch.Tensor, requires_grad: bool) -> nn.Parameter:
    """A new parameter showing ``view`` (``nn.Parameter(view)``), of the class that says whether
    ``view`` is a placeholder."""
    cls = PlaceholderParameter if type(view) is PlaceholderTensor else nn.Parameter
    return torch.Tensor._make_subclass(cls, view, requires_grad)


def check_placeholders(views: Iterable[torch.Tensor], what: str) -> None:
    """Where the block is used: a write that went around the placeholders' refusal (into their
    shared element) is undone, the poison put back, and :class:`OffloadedModelError` names
    ``handle.disable()``, the model usable as before."""
    with torch._C.DisableTorchFunctionSubclass():
        elements = {}
        for v in views:
            element = v.as_strided((), ())
            elements.setdefault(element.data_ptr(), element)
        written = [e for e in elements.values() if not _poisoned(e)]
        if not written:
            return
        with torch.no_grad():
            for element in written:
                _fill_poison(element)
    raise OffloadedModelError(f"{what} {_REFUSAL}; the write was undone. {_FIX}")


def _poisoned(element: torch.Tensor) -> bool:
    if not _fills(element.dtype):
        return bool((element.reshape(-1).view(torch.uint8) == 0xFF).all())
    if element.dtype.is_floating_point or element.dtype.is_complex:
        return bool(element.isnan())
    return bool(element == poison(element.dtype))
