"""Names for the buffers a strategy allocates, for error reports that speak the user's language.

A race report or an out-of-memory message that says "float32 storage at 0x7f..." helps nobody;
"slot 1 of layerwise FluxTransformer2DModel (block transformer_blocks.3)" points at the cause.
Strategies label their slots, resident copies and host homes here; tools that report on memory
(the fake backend's race sanitizer) ask :func:`describe`. A label may be a callable, evaluated only
when a tool asks, so that labelling a slot whose occupant changes costs nothing on the hot path.
"""

from __future__ import annotations

import threading
import weakref
from typing import Callable, Union

import torch

__all__ = ["describe", "label"]

Label = Union[str, Callable[[], str]]

# storage address -> (token of that storage's lifetime, [(first byte, end byte, label), ...]): one
# storage may hold several labelled buffers (host homes cut from one pinned slab); the token keeps
# a finalizer of a dead storage from dropping the labels of a new storage at the same address
_labels: dict[int, tuple[object, list[tuple[int, int, Label]]]] = {}
_lock = threading.Lock()
# (address, token) of storages that died, applied to _labels under the lock by the next caller: a
# finalizer can run at any allocation (a garbage collection), also inside the locked section
_dead: list[tuple[int, object]] = []


def _address(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes of its storage that ``t`` starts at and ends before (its first to last element)."""
    first = t.storage_offset() * t.element_size()
    return first, first + t.numel() * t.element_size()


def label(tensor: torch.Tensor, text: Label) -> None:
    """Name the memory ``tensor`` views until that memory is freed."""
    if tensor.numel() == 0:
        return
    storage = tensor.untyped_storage()
    address = storage.data_ptr()
    first, end = _span(tensor)
    with _lock:
        _purge()
        known = _labels.get(address)
        token = known[0] if known is not None else object()
        spans = [s for s in (known[1] if known is not None else []) if s[1] <= first or s[0] >= end]
        _labels[address] = (token, [*spans, (first, end, text)])
    if known is None:
        weakref.finalize(storage, _forget, address, token)


def _forget(address: int, token: object) -> None:
    _dead.append((address, token))  # no lock here: see _dead


def _purge() -> None:
    """Drop the labels of storages that died (the caller holds the lock)."""
    while _dead:
        address, token = _dead.pop()
        known = _labels.get(address)
        if known is not None and known[0] is token:
            del _labels[address]


def describe(tensor: torch.Tensor) -> str | None:
    """The label of the memory ``tensor`` views (the labelled buffer holding its first byte), or None."""
    if tensor.numel() == 0:
        return None
    first = _span(tensor)[0]
    with _lock:
        _purge()
        known = _labels.get(_address(tensor))
        text = next((t for start, end, t in known[1] if start <= first < end), None) if known is not None else None
    if text is None:
        return None
    try:
        return text() if callable(text) else text
    except Exception as exc:  # noqa: BLE001 - a label must never turn a report into a crash
        return f"<label failed: {exc!r}>"
