"""Where a unit's tensors lie in its per-dtype buffers: one entry per distinct tensor, one region
per span of source storage (tensors sharing memory stay views of one region), and the bytes of a
set of per-dtype buffers."""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping, Sequence

import torch

from .owners import Owner
from .subclass import has_storage, plain_alias

ALIGN_BYTES = 512  # region starts aligned as the CUDA caching allocator aligns blocks: kernels pick by alignment


@dataclasses.dataclass
class Entry:
    """One distinct tensor (by identity) of a unit, with every owner and its place in the buffer."""

    owners: list[Owner]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0  # element offset of this view in the unit's buffer for ``dtype``
    region: int = 0  # index of the storage region it views


@dataclasses.dataclass
class Composite:
    """A wrapper subclass (a quantized weight): its owners, the entries of its plain parts, and
    how to rebuild it around views of them."""

    owners: list[Owner]
    leaves: range  # indices into the unit's entries
    rebuild: Callable[[Sequence[torch.Tensor]], torch.Tensor]


@dataclasses.dataclass
class Kept:
    """A tensor that cannot be streamed: it goes to the device as it is, and back at unpack."""

    tensor: torch.Tensor
    owners: list[Owner]
    reason: str
    moved: bool = False


def storage_key(t: torch.Tensor) -> tuple:
    """Identifies the memory a tensor views, so that aliasing tensors are packed together."""
    if t.numel() == 0 or not has_storage(t):
        return ("empty", id(t))  # a wrapper subclass's parts are keyed when they are packed
    if t.is_meta:  # no memory, so no address: the storage object itself tells views apart
        return ("meta", t.untyped_storage()._cdata)
    return (t.device.type, t.device.index, plain_alias(t).untyped_storage().data_ptr())


def extent(t: torch.Tensor) -> int:
    """Elements of storage a strided tensor spans from its first element."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a``'s values copied into ``b`` are computed with as ``a`` would be: the same
    shape, strides and dtype (a kernel may sum in another order over other strides)."""
    return a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype


@dataclasses.dataclass
class Region:
    """A span of one source storage that the unit's tensors view, and where it goes in the buffer."""

    source: torch.Tensor | None  # any tensor viewing the storage; dropped once packed
    first: int  # first element of the span in the source storage
    numel: int
    dtype: torch.dtype
    start: int  # element offset in the unit's buffer for ``dtype``
    reader: object = None  # where a meta region's values are: ``read(start, count, out)``
    entries: list[int] = dataclasses.field(default_factory=list)  # indices of the entries viewing it

    def fill(self, out: torch.Tensor) -> None:
        """Write the region's values into ``out`` (flat, ``numel`` elements)."""
        if self.reader is not None:
            self.reader.read(0, self.numel, out)
        else:
            out.copy_(self.source.as_strided((self.numel,), (1,), self.first))


def region_tensor(flat: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    """Elements ``start .. start + numel`` of the flat tensor ``flat`` as a 1-D tensor whose
    storage is exactly that span: a slice of ``flat``'s storage that shares its memory (and keeps
    it alive). Meta tensors have no memory to slice and get a plain view."""
    if flat.is_meta or numel == 0:
        return flat[start : start + numel]
    size = flat.element_size()
    first = (flat.storage_offset() + start) * size
    storage = flat.untyped_storage()[first : first + numel * size]
    return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(storage, 0, (numel,), (1,))


def nbytes_of(numel: Mapping[torch.dtype, int]) -> int:
    return sum(n * dtype.itemsize for dtype, n in numel.items())
