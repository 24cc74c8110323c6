"""Where each weight unit's host home lives: the budget policy of one ``enable``.

Every unit gets one tier, decided once over all the parts of an enable call before anything is
packed (so a refused placement leaves the model untouched):

* ``PINNED``: page-locked memory, copied straight to the device;
* ``PAGEABLE``: ordinary memory copied straight (``pin_memory=False``), each copy waited for on the
  stager thread (see ``Placement._blocking_copy``);
* ``STAGED``: ordinary memory, copied through the bounce ring (see :mod:`.staging`);
* ``DISK``: no home in RAM; read from a safetensors file into the bounce ring when needed.

Policy. ``host_memory`` bounds the weights held in RAM: units that are not blocks (resident weights,
model-level components) always stay in RAM; blocks follow in order of how often they are read:
those streamed every denoising step, then a text encoder's (streamed once per pipeline call), then
the blocks kept on the device while their component runs (read once per phase switch: a second
copy in RAM would only speed that up); the blocks that no longer fit go to disk. ``pinned_memory`` bounds page-locked memory: the bounce ring
first (when anything is staged), then units in order of how often they are copied: the blocks
streamed every step, then a text encoder's blocks and swapped components, then weights copied once. This module decides; the
allocation itself stays with the strategies (``pack_units``) and the backend.

Pinned memory can run out where the placement did not foresee it: a driver or ``memlock`` limit, an
allocator that refuses. No pinned allocation is larger than ``backend.pinned_chunk_bytes`` (a
buffer larger than it is pageable unless the backend registers host memory), and when the backend
refuses one during packing, that unit and every pinned home not yet allocated go to pageable
memory, staged through the bounce ring (made then, if nothing was staged before), with a warning:
enable goes on.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import logging
from typing import Callable, Iterable, Sequence

import torch

from ..common.config import OffloadConfig
from ..device.backend import Capability

from ..base.errors import OffloadConfigError
from . import hugepages
from .slabs import SlabAllocator, aligned
from .machine import auto_pinned_budget, physical_memory, size_text as _size
from ..weights.slices import FileSlice
from .disk import checkpoint_image
from .spill import SpillFolder
from .staging import BOUNCE_BUFFERS, BounceRing, ReadAhead, Stager, Ticket, ring_buffer_bytes, ring_chunk_bytes

logger = logging.getLogger(__name__)


class Tier(enum.Enum):
    PINNED = "pinned"
    PAGEABLE = "pageable"
    STAGED = "staged"
    DISK = "disk"


#: how a part uses a unit: streamed every denoising step, streamed once per pipeline call (a text
#: encoder's layers), swapped in once per call, copied once at enable, or a block kept on the device
#: while its component's phase runs (read once per phase switch)
STREAM, PROMPT, SWAP, ONCE, SWITCH = "stream", "prompt", "swap", "once", "switch"
#: the roles of blocks, streamed or kept: the only units that may go to disk, and the order in which
#: they get RAM (what is read most often first)
STREAMED = (STREAM, PROMPT, SWITCH)
_RAM_ORDER = {STREAM: 0, PROMPT: 1, SWITCH: 2}
_PIN_ORDER = {STREAM: 0, PROMPT: 1, SWAP: 1, SWITCH: 2, ONCE: 2}


@dataclasses.dataclass
class HostUnit:
    """A unit as the policy sees it: its role and the bytes its home takes (``buffers``: the
    bytes of each of its host buffers, when they are not the unit's own per-dtype sizes)."""

    unit: object
    role: str
    nbytes: int
    buffers: tuple[int, ...] = ()

    def buffer_bytes(self) -> tuple[int, ...]:
        return self.buffers or tuple(n * dtype.itemsize for dtype, n in self.unit.numel.items())

    @property
    def pinned_bytes(self) -> int:
        """What its home takes in a pinned slab: each buffer starts at an aligned offset."""
        return sum(aligned(b) for b in self.buffer_bytes())


def ring_reserve(largest: int, disk: bool) -> int:
    """What the bounce ring takes in a pinned slab, for host buffers of at most ``largest`` bytes
    (``disk``: some are on disk, its buffers a page larger, see :func:`.staging.ring_buffer_bytes`)."""
    return BOUNCE_BUFFERS * aligned(ring_buffer_bytes(ring_chunk_bytes(largest, disk), disk))


def place_homes(parts: Sequence, config: OffloadConfig, backend) -> "Placement":
    """The tiers of every unit of ``parts`` under ``config``'s budgets. Raises
    :class:`OffloadConfigError` (before anything is touched) when blocks must go to disk and
    have nowhere to be read from."""
    units = [dataclasses.replace(h, role=PROMPT) if h.role == STREAM and part.once_per_call else h
             for part in parts for h in part.host_units()]
    pin = config.pin_memory
    host = config.host_budget.resolve(physical_memory())
    pinned = config.pinned_budget.resolve(physical_memory())
    if pinned is None and pin:
        pinned = auto_pinned_budget(backend)
    largest = max((n * d.itemsize for h in units for d, n in h.unit.numel.items()), default=0)
    # registration pins a buffer of any size chunk by chunk; an allocator, no more than a chunk at once
    chunk = None if Capability.HOST_REGISTER in backend.capabilities else backend.pinned_chunk_bytes
    # what is read once per switch may go to disk only where it can be read back from there
    units = [h if h.role != SWITCH or h.unit.from_checkpoint or config.offload_folder is not None
             else dataclasses.replace(h, role=ONCE) for h in units]
    tiers = _assign(units, pin, host, pinned or 0, reserve=0, chunk=chunk)
    ring = 0
    if any(t in (Tier.STAGED, Tier.DISK) for t in tiers.values()):
        ring = ring_reserve(largest, disk=True)
        tiers = _assign(units, pin, host, pinned or 0, reserve=ring, chunk=chunk)
        if not any(t is Tier.DISK for t in tiers.values()):  # nothing on disk under a smaller reserve either
            ring = ring_reserve(largest, disk=False)
            tiers = _assign(units, pin, host, pinned or 0, reserve=ring, chunk=chunk)
    disk = [h for h in units if tiers[id(h.unit)] is Tier.DISK]
    if config.offload_folder is None:
        _refuse_unreadable(parts, [h for h in disk if not h.unit.from_checkpoint], config)
    fixed = sum(h.nbytes for h in units if h.role not in STREAMED)
    if host is not None and fixed + ring > host:
        logger.warning(
            "host_memory=%r is below the %s that must stay in RAM (weights outside the streamed blocks, "
            "and the bounce ring); every block is read from disk", config.host_memory, _size(fixed + ring))
    oversized = [h for h in units if pin and chunk is not None and max(h.buffer_bytes(), default=0) > chunk]
    if oversized:
        logger.warning(
            "%s of homes (%d units) have a buffer larger than %s's largest pinned allocation (%s): "
            "they are pageable, staged through the bounce ring", _size(sum(h.nbytes for h in oversized)),
            len(oversized), backend.name, _size(chunk))
    placement = Placement(backend, units, tiers, ring_chunk_bytes(largest, bool(disk)) if ring else 0, pin,
                          config.offload_folder, largest)
    logger.info("host placement: %s", placement.summary())
    return placement


def _refuse_unreadable(parts: Sequence, unreadable: list[HostUnit], config: OffloadConfig) -> None:
    """Blocks that must go to disk but hold their values in memory only (no checkpoint slice to
    read them from, and no spill folder): refused, naming the components they belong to."""
    if not unreadable:
        return
    owner = {id(h.unit): id(part) for part in parts for h in part.host_units()}
    by_part: dict[int, list[HostUnit]] = {}
    for h in unreadable:
        by_part.setdefault(owner[id(h.unit)], []).append(h)
    named = []
    for part in parts:
        blocks = by_part.get(id(part))
        if blocks:
            label, kind = getattr(part, "label", None) or part.describe(), part.describe()
            what = label if label == kind else f"{label} ({kind})"
            named.append(f"{len(blocks)} blocks ({_size(sum(h.nbytes for h in blocks))}) of {what}")
    raise OffloadConfigError(
        f"host_memory={config.host_memory!r} leaves {' and '.join(named)} out of RAM, and their weights are in "
        "memory, not in a checkpoint they can be read from: the model was built or loaded outside "
        "offload_core.from_pretrained, or from_pretrained left it to diffusers or transformers (its log says why). "
        "Load it with offload_core.from_pretrained, or set offload_folder= to a folder where they can be spilled "
        "(see docs/bigger-than-ram.md)"
    )


def _assign(units: list[HostUnit], pin: bool, host: int | None, pinned: int, reserve: int,
            chunk: int | None = None) -> dict[int, Tier]:
    """Tiers by the policy of the module docstring; ``chunk``: the largest pinned buffer (None:
    any size)."""
    tiers: dict[int, Tier] = {}
    room = None if host is None else host - reserve - sum(h.nbytes for h in units if h.role not in STREAMED)
    in_ram = []
    # RAM goes to the blocks read every step, then to those read once per call, then to the kept
    # blocks read once per phase switch (a sorted copy: stable, so each component's blocks keep
    # their order)
    for h in sorted(units, key=lambda h: _RAM_ORDER.get(h.role, 0)):
        if h.role in STREAMED and room is not None:
            if h.nbytes > room:
                tiers[id(h.unit)] = Tier.DISK
                continue
            room -= h.nbytes
        in_ram.append(h)
    pinned_left = pinned - reserve
    for h in sorted(in_ram, key=lambda h: _PIN_ORDER[h.role]):
        fits = chunk is None or max(h.buffer_bytes(), default=0) <= chunk
        if pin and fits and h.pinned_bytes <= pinned_left:
            tiers[id(h.unit)] = Tier.PINNED
            pinned_left -= h.pinned_bytes
        else:
            tiers[id(h.unit)] = Tier.STAGED if pin else Tier.PAGEABLE
    return tiers


class Placement:
    """The tiers of one enable call's units, and the bounce ring and stager that serve the units
    without a pinned home. Strategies ask it where a unit lives, how to allocate its home, and
    to issue loads; it is closed when offloading ends."""

    def __init__(self, backend, units: Iterable[HostUnit], tiers: dict[int, Tier], chunk_bytes: int,
                 pin_memory: bool, folder, largest: int = 0) -> None:
        self.backend = backend
        self._tiers = tiers
        self._units = list(units)
        self._largest = largest  # the largest host buffer: what a bounce chunk made later must hold
        self._homed: set[int] = set()  # units whose home has been asked for
        self.pinned_fallback_bytes = 0  # homes placed pinned that went pageable when pinning failed
        self.bytes = {tier: 0 for tier in Tier}
        for h in self._units:
            self.bytes[tiers[id(h.unit)]] += h.nbytes
        self._chunk_bytes = chunk_bytes
        self._paged = self.bytes[Tier.DISK] > 0  # the ring stages disk homes: its chunks start on a page
        self._pin_memory = pin_memory
        # Pinned homes (and the bounce ring) are cut from slabs sized for all of them at once,
        # so that the host allocator's rounding wastes nothing (see offload_core.hostmem.slabs).
        expected = [b for h in self._units if tiers[id(h.unit)] is Tier.PINNED for b in h.buffer_bytes()]
        if chunk_bytes and pin_memory:
            expected += [ring_buffer_bytes(chunk_bytes, self._paged)] * BOUNCE_BUFFERS
        self.slabs = SlabAllocator(backend, expected) if pin_memory else None
        self._spill = SpillFolder(folder) if folder is not None else None
        self._files: set = set()  # checkpoint and spill files the units are read from: closed with the placement
        self.ring: BounceRing | None = None
        self.stager: Stager | None = None
        self.read_ahead: ReadAhead | None = None
        self._copied = None  # the event a blocking copy from a pageable home waits for
        self.blocking_copy_bytes = 0  # written on the stager thread only

    # -- policy ---------------------------------------------------------------------------
    def tier(self, unit) -> Tier:
        return self._tiers[id(unit)]

    def allocator(self, unit) -> Callable[[int, torch.dtype], torch.Tensor]:
        """How to allocate ``unit``'s home (pinned or pageable)."""
        self._homed.add(id(unit))
        self._files.update(r.reader.file for r in unit.regions if isinstance(r.reader, FileSlice))
        if self._tiers[id(unit)] is not Tier.PINNED:
            return _pageable
        return functools.partial(self._pinned_home, unit)

    def _pinned_home(self, unit, n: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer of ``unit``'s pinned home; pageable once pinned memory has run out."""
        if self._tiers[id(unit)] is Tier.PINNED:
            try:
                return self.slabs.allocate(n, dtype)
            except torch.OutOfMemoryError as exc:
                self._out_of_pinned(unit, n * dtype.itemsize, exc)
        return _pageable(n, dtype)

    def _out_of_pinned(self, unit, nbytes: int, exc: BaseException) -> None:
        """The backend refused a pinned buffer of ``unit``: it and every pinned home not yet
        allocated go to pageable memory, staged through the bounce ring."""
        moved = [h for h in self._units if self._tiers[id(h.unit)] is Tier.PINNED
                 and (h.unit is unit or id(h.unit) not in self._homed)]
        for h in moved:
            self._tiers[id(h.unit)] = Tier.STAGED
            self.bytes[Tier.PINNED] -= h.nbytes
            self.bytes[Tier.STAGED] += h.nbytes
        total = sum(h.nbytes for h in moved)
        self.pinned_fallback_bytes += total
        self.slabs.withdraw(sum(h.pinned_bytes for h in moved))
        logger.warning(
            "pinned memory ran out after %s: the backend refused %s (%s); %s of homes (%d units) placed "
            "pinned are pageable instead, staged through the bounce ring", _size(self.slabs.live_bytes),
            _size(nbytes), exc, _size(total), len(moved))
        if self.ring is None:
            self._chunk_bytes = ring_chunk_bytes(self._largest)
            self.ring = self._make_ring()
        if self.stager is None:
            self.stager = Stager(functools.partial(self.backend.bind_thread, self.backend.device()))

    def _pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return self.slabs.allocate(n, dtype)

    def _make_ring(self) -> BounceRing:
        """The bounce ring: pinned buffers, or pageable ones (each copy from them waited for) when
        memory is not pinned or pinning them fails."""
        if self._pin_memory:
            try:
                return BounceRing(self.backend, self._pinned, self._chunk_bytes, copy=self.backend.copy_async,
                                  paged=self._paged)
            except torch.OutOfMemoryError as exc:
                logger.warning("no pinned memory for the bounce ring (%s): its buffers are pageable, and each "
                               "copy from them is waited for", exc)
        if self._copied is None:
            self._copied = self.backend.new_event()
        return BounceRing(self.backend, _ring_buffer, self._chunk_bytes, copy=self._blocking_copy, paged=self._paged)

    @property
    def staging(self) -> bool:
        return self._chunk_bytes > 0

    def summary(self) -> str:
        parts = [f"{tier.value} {_size(n)}" for tier, n in self.bytes.items() if n]
        if self.staging:
            parts.append(f"bounce ring {BOUNCE_BUFFERS} x {self._chunk_bytes / 2**20:.1f} MiB")
        return ", ".join(parts) or "nothing"

    def stats(self) -> dict[str, int]:
        ring = self.ring.nbytes if self.ring is not None else 0
        return {
            # what the backend really holds for the slabs still alive, its rounding included
            "pinned_host_bytes": self.slabs.live_bytes if self.slabs is not None else 0,
            "pageable_host_bytes": self.bytes[Tier.PAGEABLE] + self.bytes[Tier.STAGED],
            "disk_bytes": self.bytes[Tier.DISK],
            "bounce_bytes": ring,
            "staged_bytes": self.ring.staged_bytes if self.ring is not None else 0,
            "disk_read_bytes": self.ring.disk_read_bytes if self.ring is not None else 0,
            "disk_read_seconds": self.ring.disk_read_seconds if self.ring is not None else 0.0,
            # copies from pageable memory (homes, or the ring's buffers), each waited for on the
            # stager thread: they cannot overlap compute the way pinned ones do
            "blocking_copy_bytes": self.blocking_copy_bytes,
            # homes placed pinned that are pageable because the backend refused pinned memory
            "pinned_fallback_bytes": self.pinned_fallback_bytes,
        }

    # -- lifecycle ------------------------------------------------------------------------
    def attach(self, parts: Sequence, txn) -> None:
        """First step of an enable transaction: give ``parts`` this placement and, when some
        unit needs them, allocate the bounce ring and start the stager."""
        txn.on_rollback(self.close)
        if not self._pin_memory:
            self._copied = self.backend.new_event()
        if self.staging:
            self.ring = self._make_ring()
        if self.staging or self.bytes[Tier.PAGEABLE]:
            # the device of this (enabling) thread, so that the stager's work goes to it too
            self.stager = Stager(functools.partial(self.backend.bind_thread, self.backend.device()))
        if self.bytes[Tier.DISK]:
            self.read_ahead = ReadAhead()
        for part in parts:
            part.placement = self

    def close(self) -> None:
        """Stop the stager, release the ring once its last copies have run, close the descriptors
        of the checkpoint and spill files units were read from (now, not when the last tensor
        naming them is collected) and remove spilled files."""
        if self.stager is not None:
            self.stager.close()
            self.stager = None
        if self.read_ahead is not None:
            self.read_ahead.close()
            self.read_ahead = None
        if self.ring is not None:
            for event in self.ring.read_done:
                event.synchronize()
            self.ring = None
        for file in self._files:
            file.close()
        self._files.clear()
        if self._spill is not None:
            self._spill.remove()
        if self.slabs is not None:
            self.slabs.close()  # registered slabs a caller still holds a view of
        self.backend.empty_host_cache()  # pinned blocks the host allocator still caches

    def unpack(self, unit, bound=None) -> None:
        """Give ``unit``'s tensors ordinary host memory again (``bound``: the views its owners show,
        see ``WeightUnit.unpack``). When that frees the last home in a pinned slab, the slab goes
        back to the system at once (the host cache is emptied), so ``disable`` returns pinned
        memory slab by slab. A home on disk whose file can no longer be read is given up
        (``WeightUnit.lose``), with an error logged, so that ``disable`` always finishes."""
        before = self.slabs.live_slabs if self.slabs is not None else 0
        try:
            unit.unpack(bound)
        except (OSError, EOFError) as exc:  # a file of its home on disk is gone or damaged
            if unit.image is None:
                raise
            logger.error("%s: its weights could not be read back from %s (%s); they are left on the meta device",
                         unit.name, ", ".join(sorted(f.path for f in unit.image.files())), exc)
            unit.lose()
        if self.slabs is not None and self.slabs.live_slabs < before:
            self.backend.empty_host_cache()

    def spill(self, unit) -> None:
        """Give ``unit`` its home on disk: the checkpoint it comes from, or files in the spill
        folder written straight from its tensors."""
        image = self._spill.write(unit) if self._spill is not None else checkpoint_image(unit)
        self._files.update(image.files())
        unit.spill(image)

    # -- loads ----------------------------------------------------------------------------
    def transfers(self, unit, dst: dict[torch.dtype, torch.Tensor]) -> list[tuple[torch.Tensor, object]]:
        """(device view, source) per dtype: the source is the pinned or pageable host buffer to
        copy straight, or a reader whose elements go through the bounce ring."""
        tier = self._tiers[id(unit)]
        if tier in (Tier.PINNED, Tier.PAGEABLE):
            return [(dst[dtype][: src.numel()], src) for dtype, src in unit.host.items()]
        if tier is Tier.DISK:
            return [(dst[dtype][:n], ImageReader(unit, dtype)) for dtype, n in unit.numel.items()]
        return [(dst[dtype][:n], functools.partial(unit.read, dtype)) for dtype, n in unit.numel.items()]

    def copies(self, transfers) -> int:
        """The copies ``transfers`` take: one per direct buffer, one per bounce chunk."""
        return sum(
            1 if isinstance(src, torch.Tensor) else self._chunks(dst.numel() * dst.element_size(), src)
            for dst, src in transfers
        )

    def _chunks(self, nbytes: int, read) -> int:
        residue = getattr(read, "residue", None)
        if self.ring is None or residue is None:
            return -(-nbytes // self._chunk_bytes)
        return self.ring.copies(nbytes, residue)

    def issue(self, transfers, stream) -> None:
        """Queue ``transfers`` on ``stream`` (on the stager thread when anything is staged or
        pageable)."""
        staged = []
        for dst, src in transfers:
            if not isinstance(src, torch.Tensor):
                staged.append((dst, src, getattr(src, "residue", None)))
            elif self._pin_memory:  # then every direct source is a pinned home
                self.backend.copy_async(dst, src, stream)
            else:
                self._blocking_copy(dst, src, stream)
        if staged:
            self.ring.stage(staged, stream)

    def _blocking_copy(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """A copy from pageable memory (a home, or a pageable bounce buffer), waited for here on
        purpose. A runtime may make such a copy wait for everything queued before it on
        ``stream`` (Ascend's runtime always does, CUDA may); waiting for it explicitly does so on
        every backend, on the stager thread rather than the thread that issues compute, and the
        bytes show in ``stats()``."""
        self.backend.copy_async(dst, src, stream)
        self._copied.record(stream)
        self._copied.synchronize()
        self.blocking_copy_bytes += src.nbytes

    def staging_block(self, images, i: int) -> None:
        """The stager starts staging block ``i`` of ``images`` (the blocks' disk images in run
        order): read ahead after it."""
        if self.read_ahead is not None:
            self.read_ahead.staging(images, i)

    def run(self, task: Callable[[], None]) -> Ticket | None:
        """Run ``task`` (a load: waits, copies, a ready event) now, or hand it to the stager."""
        if self.stager is None:
            task()
            return None
        return self.stager.submit(task)

    def wait(self, ticket: Ticket | None) -> None:
        if ticket is not None:
            self.stager.wait(ticket)

    def drain(self) -> None:
        """Block until every load handed to the stager has been issued."""
        if self.stager is not None:
            self.stager.drain()


class ImageReader:
    """A disk unit's reader of one dtype: the bytes it read from files count in
    ``disk_read_bytes``, and its ``residue`` lets the ring lay them out as their files do."""

    __slots__ = ("unit", "dtype")

    def __init__(self, unit, dtype: torch.dtype) -> None:
        self.unit = unit
        self.dtype = dtype

    def __call__(self, start: int, count: int, out: torch.Tensor) -> int:
        return self.unit.image.read(self.dtype, start, count, out)

    def submit(self, start: int, count: int, out: torch.Tensor):
        """The read, returning once it is queued: (bytes from files, a function that returns
        once they have landed); the ring keeps several in flight (``BounceRing.stage``)."""
        return self.unit.image.submit(self.dtype, start, count, out)

    @property
    def residue(self) -> int | None:
        return self.unit.image.residue(self.dtype)


def _pageable(n: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(n, dtype=dtype)


def _ring_buffer(n: int, dtype: torch.dtype) -> torch.Tensor:
    """A pageable bounce buffer: on huge pages, since disk reads land in it (:mod:`.hugepages`)."""
    return hugepages.empty(n * dtype.itemsize).view(dtype)
