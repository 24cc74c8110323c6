"""Weight units: groups of tensors that move between host and device together.

A unit's home is one flat host buffer per dtype. Every tensor of the unit is a strided view into
its buffer, placed so that tensors sharing a storage (tied weights, views of one another) stay
views of one region: packing works on storage regions, not on tensors. Binding a unit to another
set of per-dtype buffers (a device slot) re-points every owner — parameters through ``.data`` so
their identity, ``requires_grad`` and ties survive; buffers by replacing them in their module —
without copying anything, and moving a unit is then one copy per dtype.

Quantized weights (tensor subclasses) are packed through their plain parts, see :mod:`.subclass`;
a subclass that cannot be streamed is kept on the device, outside the buffers.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from .subclass import Unstreamable, assign_param, flatten, has_storage, like, plain_alias

logger = logging.getLogger(__name__)

ALIGN_BYTES = 64  # region starts aligned for vectorised copies and kernels


class UnsupportedTensorError(TypeError):
    """A tensor the packer cannot move faithfully (a meta or sparse tensor, mixed-dtype aliasing)."""


@dataclasses.dataclass(frozen=True)
class Owner:
    """One place a tensor is reachable from: ``module.<name>`` as a parameter or a buffer."""

    module: nn.Module
    name: str
    is_param: bool

    def get(self) -> torch.Tensor:
        return (self.module._parameters if self.is_param else self.module._buffers)[self.name]

    def rebind(self, tensor: torch.Tensor) -> None:
        if self.is_param:
            assign_param(self.module._parameters[self.name], tensor)
        else:
            self.module._buffers[self.name] = like(self.module._buffers[self.name], tensor)


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
    return (t.device.type, t.device.index, plain_alias(t).untyped_storage().data_ptr())


def extent(t: torch.Tensor) -> int:
    """Elements of storage a strided tensor spans from its first element."""
    if t.numel() == 0:
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def collect_tensors(modules: Iterable[nn.Module]) -> dict[int, tuple[torch.Tensor, list[Owner]]]:
    """Every parameter and buffer reachable from ``modules``, by tensor identity, with owners."""
    found: dict[int, tuple[torch.Tensor, list[Owner]]] = {}
    seen_modules: set[int] = set()
    for root in modules:
        for module in root.modules():
            if id(module) in seen_modules:
                continue
            seen_modules.add(id(module))
            for is_param, table in ((True, module._parameters), (False, module._buffers)):
                for name, t in table.items():
                    if t is None:
                        continue
                    found.setdefault(id(t), (t, []))[1].append(Owner(module, name, is_param))
    return found


def check_supported(t: torch.Tensor, where: str) -> None:
    if t.is_meta:
        raise UnsupportedTensorError(f"{where} is on the meta device: load real weights before enabling offload")
    if t.is_sparse or t.layout != torch.strided:
        raise UnsupportedTensorError(f"{where} has layout {t.layout}; only strided tensors can be offloaded")


@dataclasses.dataclass
class Region:
    """A span of one source storage that the unit's tensors view, and where it goes in the buffer."""

    source: torch.Tensor | None  # any tensor viewing the storage; dropped once packed
    first: int  # first element of the span in the source storage
    numel: int
    dtype: torch.dtype
    start: int  # element offset in the unit's buffer for ``dtype``


class WeightUnit:
    """A named group of tensors with a per-dtype layout, packed into host buffers on demand."""

    def __init__(self, name: str, tensors: Mapping[int, tuple[torch.Tensor, list[Owner]]]) -> None:
        self.name = name
        self.entries: list[Entry] = []
        self.regions: list[Region] = []
        self.numel: dict[torch.dtype, int] = {}
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.composites: list[Composite] = []
        self.kept: list[Kept] = []
        by_storage: dict[tuple, list[tuple[torch.Tensor, Entry]]] = {}

        def add(t: torch.Tensor, owners: list[Owner]) -> None:
            entry = Entry(owners, tuple(t.shape), tuple(t.stride()), t.dtype)
            self.entries.append(entry)
            by_storage.setdefault(storage_key(t), []).append((t, entry))

        for t, owners in tensors.values():
            where = f"{name}: {owners[0].name}"
            check_supported(t, where)
            if has_storage(t):
                add(t, owners)
                continue
            try:
                flat = flatten(t, where)
            except Unstreamable as exc:
                self.kept.append(Kept(t, owners, str(exc)))
                continue
            first = len(self.entries)
            for leaf in flat.leaves:
                add(leaf, [])
            self.composites.append(Composite(owners, range(first, len(self.entries)), flat.rebuild))
        for members in by_storage.values():
            self._place(members)
        if self.kept:
            logger.warning(
                "%s: %d tensors cannot be streamed and stay on the device: %s", name, len(self.kept),
                "; ".join(k.reason for k in self.kept[:4]) + (" ..." if len(self.kept) > 4 else ""),
            )

    def _place(self, members: list[tuple[torch.Tensor, Entry]]) -> None:
        dtype = members[0][0].dtype
        if any(t.dtype != dtype for t, _ in members):
            names = ", ".join(e.owners[0].name for _, e in members)
            raise UnsupportedTensorError(f"{self.name}: tensors {names} share memory with different dtypes")
        first = min(t.storage_offset() for t, _ in members)
        last = max(t.storage_offset() + extent(t) for t, _ in members)
        align = max(1, ALIGN_BYTES // dtype.itemsize)
        start = -(-self.numel.get(dtype, 0) // align) * align
        self.numel[dtype] = start + (last - first)
        for t, entry in members:
            entry.offset = start + t.storage_offset() - first
            entry.region = len(self.regions)
        self.regions.append(Region(plain_alias(members[0][0]), first, last - first, dtype, start))

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.numel)

    def views(self, buffers: Mapping[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Each entry's tensor as a view of ``buffers`` (per-dtype flat tensors)."""
        return [buffers[e.dtype].as_strided(e.size, e.stride, e.offset) for e in self.entries]

    def owner_lists(self) -> list[list[Owner]]:
        """The owners of each tensor :meth:`tensors` returns, in the same order."""
        return [e.owners for e in self.entries if e.owners] + [c.owners for c in self.composites]

    def tensors(self, views: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The owned tensors built on ``views`` (one per entry, as :meth:`views` makes them):
        plain views as they are, quantized weights rebuilt around their parts."""
        plain = [v for e, v in zip(self.entries, views) if e.owners]
        return plain + [c.rebuild([views[k] for k in c.leaves]) for c in self.composites]

    def _rebind(self, views: Sequence[torch.Tensor]) -> None:
        for owners, tensor in zip(self.owner_lists(), self.tensors(views)):
            for owner in owners:
                owner.rebind(tensor)

    def bind(self, buffers: Mapping[torch.dtype, torch.Tensor]) -> None:
        """Point every owner at its view of ``buffers``. No data moves."""
        self._rebind(self.views(buffers))

    def keep_on(self, device: torch.device) -> None:
        """Move the tensors that cannot be streamed to ``device``, each by its own ``.to()``."""
        for k in self.kept:
            moved = k.tensor.to(device)
            if moved is not k.tensor:
                for owner in k.owners:
                    owner.rebind(moved)
                k.moved = True

    def originals(self) -> list[tuple[Owner, torch.Tensor]]:
        """Each owner with the tensor it holds now, for putting it back after a failed enable."""
        pairs = [(o, o.get().data) for owners in self.owner_lists() for o in owners]
        return pairs + [(o, k.tensor) for k in self.kept for o in k.owners]

    def pack(self, allocate: Callable[[int, torch.dtype], torch.Tensor]) -> None:
        """Copy the unit's tensors into fresh host buffers (``allocate(numel, dtype)``) and bind
        the unit to them.

        Afterwards the unit holds no reference to the original tensors, so their memory is freed
        as soon as nobody else holds them: packing unit by unit keeps host memory near one copy.
        Whole storage spans are copied, so gaps, overlaps and zero strides survive.
        """
        host = {dtype: allocate(n, dtype) for dtype, n in self.numel.items()}
        for r in self.regions:
            if r.numel:
                host[r.dtype][r.start : r.start + r.numel].copy_(r.source.as_strided((r.numel,), (1,), r.first))
        self.host = host
        self.bind(host)
        for r in self.regions:
            r.source = None

    def unpack(self) -> None:
        """Give every owner an ordinary host tensor (same values, dtype, strides, sharing).

        Each storage region gets its own storage again, so tensors that did not share memory
        before packing do not share it afterwards (safetensors refuses shared storage).
        """
        plain = [
            self.host[r.dtype][r.start : r.start + r.numel].to("cpu", copy=True) for r in self.regions
        ]
        self._rebind([
            plain[e.region].as_strided(e.size, e.stride, e.offset - self.regions[e.region].start) for e in self.entries
        ])
        for k in self.kept:
            if k.moved:
                for owner in k.owners:
                    owner.rebind(k.tensor)
                k.moved = False
        self.host = {}

    def __repr__(self) -> str:
        return f"<WeightUnit {self.name}: {len(self.entries)} tensors, {self.nbytes} bytes>"


def slot_numel(units: Iterable[WeightUnit]) -> dict[torch.dtype, int]:
    """Per-dtype size of a slot that can hold any of ``units``."""
    need: dict[torch.dtype, int] = {}
    for unit in units:
        for dtype, n in unit.numel.items():
            need[dtype] = max(need.get(dtype, 0), n)
    return need


def nbytes_of(numel: Mapping[torch.dtype, int]) -> int:
    return sum(n * dtype.itemsize for dtype, n in numel.items())
