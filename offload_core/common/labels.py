"""Names for the buffers a strategy allocates, for error reports that speak the user's language.

A race report or an out-of-memory message that says "float32 storage at 0x7f..." helps nobody;
"slot 1 of layerwise FluxTransformer2DModel (block transformer_blocks.3)" points at the cause.
Strategies label their slots, resident copies and host homes here; tools that report on memory
(the fake backend's race sanitizer) ask :func:`describe`. A label may be a callable, evaluated only
when a tool asks, so that labelling a slot whose occupant changes costs nothing on the hot path.

There is no lock here, and no Python code runs when a storage dies. Both used to hang the
process: ``label`` runs inside ``enable`` and a forward, where a Ctrl-C (or a trace function
raising) can land between the end of a locked block and the release of its lock, and a garbage
collection can run a storage's finalizer inside a locked block on the same thread. So every
change is one operation on a dict (atomic under the interpreter lock): a storage's labels are a
dict of their own, filed under a weak reference to the storage whose callback is that table's
own ``pop`` (a C method: the entry goes with the storage, whatever is running at the time).
"""

from __future__ import annotations

import weakref
from typing import Callable, Union

import torch

__all__ = ["describe", "label"]

Label = Union[str, Callable[[], str]]

# weak reference to a live storage -> {(first byte, end byte): label}: one storage may hold several
# labelled buffers (host homes cut from one pinned slab)
_labels: dict[weakref.ref, dict[tuple[int, int], Label]] = {}


def _span(t: torch.Tensor) -> tuple[int, int]:
    """Bytes of its storage that ``t`` starts at and ends before (its first to last element)."""
    first = t.storage_offset() * t.element_size()
    return first, first + t.numel() * t.element_size()


def label(tensor: torch.Tensor, text: Label) -> None:
    """Name the memory ``tensor`` views until that memory is freed. A label replaces those of
    the bytes it overlaps."""
    if tensor.numel() == 0:
        return
    storage = tensor.untyped_storage()
    spans = _labels.get(weakref.ref(storage))
    if spans is None:  # the first label of this storage (another thread's may win the setdefault)
        spans = _labels.setdefault(weakref.ref(storage, _labels.pop), {})
    first, end = _span(tensor)
    spans[first, end] = text  # before the overlapped labels go: an interrupt leaves this one in place
    for span in [s for s in spans.copy() if s[0] < end and first < s[1] and s != (first, end)]:
        spans.pop(span, None)


def describe(tensor: torch.Tensor) -> str | None:
    """The label of the memory ``tensor`` views (the labelled buffer holding its first byte), or None."""
    if tensor.numel() == 0:
        return None
    spans = _labels.get(weakref.ref(tensor.untyped_storage()))
    if spans is None:
        return None
    first = _span(tensor)[0]
    text = next((t for (start, end), t in spans.copy().items() if start <= first < end), None)
    if text is None:
        return None
    try:
        return text() if callable(text) else text
    except Exception as exc:  # noqa: BLE001 - a label must never turn a report into a crash
        return f"<label failed: {exc!r}>"
