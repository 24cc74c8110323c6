"""Weight units: groups of tensors that move between host and device together.

A unit's home is one flat host buffer per dtype. Every tensor of the unit is a strided view into
its buffer, placed so that tensors sharing a storage (tied weights, views of one another) stay
views of one region: packing works on storage regions, not on tensors. Binding a unit to another
set of per-dtype buffers (a device slot) re-points every owner — parameters through ``.data`` so
their identity, ``requires_grad`` and ties survive; buffers by replacing them in their module —
without copying anything, and moving a unit is then one copy per dtype.

A unit's home is in RAM (``host``: pinned or pageable buffers) or on disk (``image``: where each
region's bytes lie in safetensors files). A tensor on the meta device may carry, as the attribute
named by :data:`SOURCE_ATTRIBUTE`, the checkpoint slice its values come from (``from_pretrained``
builds models that way): packing then reads the slice straight into the unit's home.

Quantized weights (tensor subclasses) are packed through their plain parts, see :mod:`.subclass`;
a subclass that cannot be streamed is kept on the device, outside the buffers.
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping, Sequence

import torch

from ..base.errors import Unstreamable, UnsupportedTensorError
from .layout import ALIGN_BYTES, Composite, Entry, Kept, Region, extent, nbytes_of, region_tensor, storage_key
from .owners import SOURCE_ATTRIBUTE, Owner, check_supported
from .placeholders import parameter
from .subclass import flatten, has_storage, plain_alias

logger = logging.getLogger(__name__)


class WeightUnit:
    """A named group of tensors with a per-dtype layout, packed into host buffers on demand."""

    def __init__(self, name: str, tensors: Mapping[int, tuple[torch.Tensor, list[Owner]]], report: bool = True) -> None:
        """``report``: warn about the tensors that cannot be streamed (False where the unit is only
        measured, by the planner: the strategy that packs it warns once)."""
        self.name = name
        self.entries: list[Entry] = []
        self.regions: list[Region] = []
        self.numel: dict[torch.dtype, int] = {}
        self.host: dict[torch.dtype, torch.Tensor] = {}
        self.composites: list[Composite] = []
        self.kept: list[Kept] = []
        self.image = None  # a DiskImage when the unit's home is on disk
        self.host_views: list[torch.Tensor] = []  # what owners show at home (views of ``host``, or placeholders)
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
        for index, entry in enumerate(self.entries):
            self.regions[entry.region].entries.append(index)
        if self.kept and report:
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
        reader = None
        if members[0][0].is_meta:
            covering = [t for t, _ in members if t.storage_offset() == first and extent(t) == last - first]
            reader = getattr(covering[0], SOURCE_ATTRIBUTE, None) if covering else None
            if reader is None:
                names = ", ".join(e.owners[0].name for _, e in members)
                raise UnsupportedTensorError(f"{self.name}: meta tensors {names} have no checkpoint slice to load")
        self.regions.append(Region(plain_alias(members[0][0]), first, last - first, dtype, start, reader))

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.numel)

    @property
    def from_checkpoint(self) -> bool:
        """True if the unit's values are read from checkpoint files rather than held in memory."""
        return any(r.reader is not None for r in self.regions)

    def views(self, buffers: Mapping[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Each entry's tensor as a view of ``buffers`` (per-dtype flat tensors, which may
        themselves be views into a larger storage, such as a pinned slab)."""
        return [
            buffers[e.dtype].as_strided(e.size, e.stride, buffers[e.dtype].storage_offset() + e.offset)
            for e in self.entries
        ]

    def region_views(self, buffers: Mapping[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Each entry's tensor as :meth:`views` does, over a storage of its region's own (a slice
        of the buffer's storage, same memory): what a user reaches from the model (``p.detach()``,
        ``p.data``) then looks as independent as before packing, and ``torch.save`` of one tensor
        writes its region, not the whole buffer. Tensors of one region share its storage, so ties
        and views of one another survive."""
        spans = [region_tensor(buffers[r.dtype], r.start, r.numel) for r in self.regions]
        return [
            spans[e.region].as_strided(e.size, e.stride, e.offset - self.regions[e.region].start)
            for e in self.entries
        ]

    def owners(self) -> Iterable[Owner]:
        for entry in self.entries:
            yield from entry.owners

    def bind(self, views: Sequence[torch.Tensor]) -> None:
        """Point every owner at its view (from :meth:`views`). No data moves."""
        for entry, view in zip(self.entries, views):
            if entry.owners:
                _bind_entry(entry, view)
        self._bind_composites(views)

    def foreign(self, views: Sequence[torch.Tensor]) -> list[tuple[int, Owner]]:
        """(entry index, owner) of every owner that no longer shows its view in ``views`` (the
        ones it was last bound to): the user replaced the tensor or the parameter's data."""
        return [
            (index, owner)
            for index, (entry, view) in enumerate(zip(self.entries, views))
            for owner in entry.owners
            if not owner.bound_to(view)
        ]

    def _bind_composites(self, views: Sequence[torch.Tensor]) -> None:
        """Rebuild each quantized weight around ``views`` of its parts and bind its owners."""
        for c in self.composites:
            tensor = c.rebuild([views[k] for k in c.leaves])
            for owner in c.owners:
                owner.rebind(tensor)

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
        owners = [e.owners for e in self.entries] + [c.owners for c in self.composites]
        return [(o, o.get().data) for group in owners for o in group] + [(o, k.tensor) for k in self.kept for o in k.owners]

    def pack(self, allocate: Callable[[int, torch.dtype], torch.Tensor]) -> None:
        """Copy the unit's tensors into fresh host buffers (``allocate(numel, dtype)``) and bind
        the unit to them.

        Each region's owners are re-pointed as soon as it is copied, and the unit keeps no
        reference to the original tensors, so each original is freed as soon as nobody else holds
        it: host memory during packing stays near one copy of the model. Whole storage spans are
        copied, so gaps, overlaps and zero strides survive.
        """
        host = {dtype: allocate(n, dtype) for dtype, n in self.numel.items()}
        views = self.region_views(host)  # a buffer may be a view into a pinned slab: views are relative to it
        replaced: list[tuple[Owner, torch.Tensor]] = []  # meta parameters replaced by real ones
        done = 0
        try:
            for done, r in enumerate(self.regions, 1):
                if r.numel:
                    r.fill(host[r.dtype][r.start : r.start + r.numel])
                for index in r.entries:
                    if self.entries[index].owners:
                        replaced += _bind_entry(self.entries[index], views[index])
                r.source = r.reader = None
        except BaseException:  # an error or Ctrl-C half way: the owners get their values back
            self._unbind(host, views, self.regions[:done], replaced)
            raise
        self.host = host
        self.host_views = views
        self._bind_composites(views)

    def _unbind(self, host, views, regions, replaced) -> None:
        """Undo part of a ``pack``: the owners of ``regions`` that show their home get ordinary
        host tensors with the same values (sharing within a region kept), and meta parameters
        replaced by real ones get their own object back. The home itself is not kept."""
        for owner, original in replaced:
            owner.replace(original)
        for r in regions:
            plain = torch.empty(r.numel, dtype=r.dtype)
            if r.numel:
                plain.copy_(host[r.dtype][r.start : r.start + r.numel])
            for index in r.entries:
                entry = self.entries[index]
                for owner in entry.owners:
                    if owner.bound_to(views[index]):
                        owner.rebind(plain.as_strided(entry.size, entry.stride, entry.offset - r.start))

    def spill(self, image) -> None:
        """Give the unit a home on disk: ``image`` (a DiskImage) now says where every region's
        bytes are. The owners keep their tensors until the unit is bound elsewhere (a slot)."""
        self.image = image
        for r in self.regions:
            r.source = r.reader = None

    def take(self, allocate: Callable[[int, torch.dtype], torch.Tensor]) -> dict[torch.dtype, torch.Tensor]:
        """The unit's values in fresh buffers laid out as its home, without binding anything; the
        unit keeps no reference to the original tensors afterwards."""
        buffers = {dtype: allocate(n, dtype) for dtype, n in self.numel.items()}
        for r in self.regions:
            if r.numel:
                r.fill(buffers[r.dtype][r.start : r.start + r.numel])
            r.source = r.reader = None
        return buffers

    def read(self, dtype: torch.dtype, start: int, count: int, out: torch.Tensor) -> None:
        """Elements ``start .. start + count`` of the home's ``dtype`` buffer into ``out``."""
        if self.image is not None:
            self.image.read(dtype, start, count, out)
        else:
            out.copy_(self.host[dtype][start : start + count])

    def home(self) -> dict[torch.dtype, torch.Tensor]:
        """The home's buffers: the RAM ones, or fresh copies read from disk."""
        if self.image is None:
            return self.host
        buffers = {dtype: torch.empty(n, dtype=dtype) for dtype, n in self.numel.items()}
        for dtype, buffer in buffers.items():
            self.read(dtype, 0, buffer.numel(), buffer)
        return buffers

    def plain(self, source: Mapping[torch.dtype, torch.Tensor]) -> list[torch.Tensor]:
        """Each entry's tensor as an ordinary host tensor with the values in ``source``: one new
        storage per region, so sharing within a region survives and nothing else is shared."""
        copies = [source[r.dtype][r.start : r.start + r.numel].to("cpu", copy=True) for r in self.regions]
        return [
            copies[e.region].as_strided(e.size, e.stride, e.offset - self.regions[e.region].start)
            for e in self.entries
        ]

    def unpack(self, bound: Sequence[torch.Tensor] | None = None) -> None:
        """Give every owner an ordinary host tensor (same values, dtype, strides, sharing) with the
        home's values.

        ``bound`` are the views owners were last bound to (default: what they show at home). An
        owner the user has given another tensor keeps it: that tensor is the truth. Each storage
        region gets its own storage again, so tensors that did not share memory before packing do
        not share it afterwards (safetensors refuses shared storage). The home is released
        afterwards, so unpacking unit by unit keeps host memory near one copy. Calling it again
        does nothing, and an interrupted call can be repeated: owners already given their copy
        keep it.
        """
        if not self.host and self.image is None and not any(k.moved for k in self.kept):
            return
        bound = self.host_views if bound is None else bound
        views: list[torch.Tensor] = [torch.empty(0)] * len(self.entries)
        for r in self.regions:
            plain = torch.empty(r.numel, dtype=r.dtype)
            if r.numel:
                self.read(r.dtype, r.start, r.numel, plain)
            for index in r.entries:
                entry = self.entries[index]
                views[index] = plain.as_strided(entry.size, entry.stride, entry.offset - r.start)
                if not entry.owners:
                    continue
                if not bound:  # never bound to anything but its home (a rolled-back enable)
                    _bind_entry(entry, views[index])
                    continue
                for owner in entry.owners:
                    if owner.bound_to(bound[index]):
                        owner.rebind(views[index])
        self._bind_composites(views)
        self._unpacked()

    def lose(self) -> None:
        """Give up a home on disk that can no longer be read (its file gone or damaged): every
        owner gets a tensor of its shape, strides and dtype on the meta device, so that using it
        fails loudly instead of computing with wrong values, and the unit is unpacked."""
        for r in self.regions:
            flat = torch.empty(r.numel, dtype=r.dtype, device="meta")
            for index in r.entries:
                entry = self.entries[index]
                if entry.owners:
                    _bind_entry(entry, flat.as_strided(entry.size, entry.stride, entry.offset - r.start))
        self._unpacked()

    def _unpacked(self) -> None:
        """The kept tensors back with their owners, and no home left: the end of an unpack or a loss."""
        for k in self.kept:
            if k.moved:
                for owner in k.owners:
                    owner.rebind(k.tensor)
                k.moved = False
        self.host = {}
        self.image = None
        self.host_views = []

    def __repr__(self) -> str:
        return f"<WeightUnit {self.name}: {len(self.entries)} tensors, {self.nbytes} bytes>"



def _bind_entry(entry: Entry, view: torch.Tensor) -> list[tuple[Owner, torch.Tensor]]:
    """Re-point every owner of ``entry`` at ``view``; a parameter still on the meta device is
    replaced by one new parameter object shared by all its owners, so ties survive. Returns the
    owners replaced that way, each with what it held."""
    first = entry.owners[0]
    current = first.param if first.is_param else first.get()
    if current.is_meta == view.is_meta:
        for owner in entry.owners:
            owner.rebind(view)
        return []
    replacement = parameter(view, current.requires_grad) if entry.owners[0].is_param else view
    replaced = []
    for owner in entry.owners:
        replaced.append((owner, owner.param if owner.is_param else owner.get()))
        owner.replace(replacement)
    return replaced
