"""Pinned host homes cut from a few large pinned slabs.

One pinned allocation per buffer wastes memory on every accelerator we target: torch's caching
host allocator rounds each request up to a power of two (a block of 0.6 x 2^k bytes takes 2^k)
and keeps freed blocks cached. So a weight unit's host buffers are views into slabs, and a slab
is always a size the backend hands out without rounding (``DeviceBackend.pinned_allocation_size``)
or the whole rounded block, used to its end.

Slab sizes follow what is left to pack (the caller announces every request up front): a slab holds at
least ``REQUESTS_PER_SLAB`` of the largest request (and ``MIN_SLAB_BYTES``) unless less is left,
and when the rounded block for what is left would waste more than one request, the slab is the
next size down and the rest goes into later, smaller slabs.

Requests fill the newest slab in order; one that does not fit opens the next slab, leaving the
previous one an unused tail smaller than that request. The allocator holds slabs weakly: a slab
lives exactly as long as some view of it does. Filling in order is what makes the pinned memory of
a model come back slab by slab as its units are unpacked (in the order they were packed): a later
unit tucked into an earlier slab's tail would keep that slab alive to the end.

The slab size trades waste against that release: a slab wastes less than one request (so at most
1/``REQUESTS_PER_SLAB`` of it), and ``disable`` holds at most about one slab beyond the weights
it has not yet given back. Hence a request the backend allocates at its exact size (the fake
without ``pinned_rounding``) gets an allocation of its own: nothing would be saved by sharing,
and its memory goes as soon as its unit is unpacked.

No allocation is larger than ``backend.pinned_chunk_bytes``: drivers refuse a single huge pinned
allocation, so slabs are capped at it, and the placement gives a buffer larger than it pageable
memory (:func:`offload_core.hostmem.placement.place_homes`). A backend that registers host
memory (:data:`~offload_core.Capability.HOST_REGISTER`) gets slabs of registered memory instead
(:mod:`.registered`), sized as above but exact to the page, so the pinned bytes are the packed
bytes plus their alignment; each is registered in chunks, so a buffer of any size can be pinned
(and sharing a slab saves a registration per buffer).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import weakref
from typing import Iterable

import torch

from ..device.backend import Capability
from ..base.locks import locked
from ..weights.unit import ALIGN_BYTES
from .registered import RegisteredMemory, page_round

logger = logging.getLogger(__name__)

#: smallest slab worth a pinned allocation of its own, when there is that much to pack
MIN_SLAB_BYTES = 64 * 2**20
#: a slab holds at least this many of the largest request, so a tail left because a request did
#: not fit wastes at most 1/REQUESTS_PER_SLAB of the slab
REQUESTS_PER_SLAB = 4


def aligned(nbytes: int) -> int:
    """Bytes a request takes in a slab: views start at ``ALIGN_BYTES`` boundaries."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@dataclasses.dataclass
class Slab:
    storage: weakref.ref  # the slab's untyped storage, alive while any view of it is
    capacity: int
    used: int = 0

    @property
    def tail(self) -> int:
        return self.capacity - self.used


class SlabAllocator:
    """Sub-allocates host buffers from pinned slabs of ``backend``.

    ``expected``: the byte sizes of every request to come, so that slabs fit what is packed;
    requests beyond those still work, in slabs of the usual size. ``slab_bytes`` overrides the
    largest slab size.
    """

    def __init__(self, backend, expected: Iterable[int] = (), slab_bytes: int | None = None) -> None:
        sizes = [aligned(n) for n in expected]
        self.backend = backend
        self.largest = max(sizes, default=0)
        self.slab_bytes = slab_bytes or max(MIN_SLAB_BYTES, REQUESTS_PER_SLAB * self.largest)
        self.registered = RegisteredMemory(backend) if Capability.HOST_REGISTER in backend.capabilities else None
        if self.registered is None:  # registration pins a slab of any size, chunk by chunk
            self.slab_bytes = min(self.slab_bytes, backend.pinned_chunk_bytes)
        self._remaining = sum(sizes)
        self._slabs: list[Slab] = []
        # weak reference to a live slab's storage -> the pinned bytes it really takes. A slab's
        # death runs no Python code (a garbage collection may run it inside allocate(), and a
        # Ctrl-C landing in a Python finalizer is swallowed with its work half done): the
        # reference's callback is this dict's own pop, so the counts below are exact at any time.
        self._live: dict[weakref.ref, int] = {}
        self._lock = threading.Lock()  # threads allocating at once (taken through locks.locked)

    @property
    def live_bytes(self) -> int:
        """Real pinned bytes of the slabs still alive."""
        return sum(self._live.copy().values())

    @property
    def live_slabs(self) -> int:
        return len(self._live)

    def allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat pinned tensor of ``numel`` elements: a view into a slab."""
        return locked(self._lock, self._allocate, numel, dtype)

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        need = aligned(nbytes)
        self.largest = max(self.largest, need)
        slab, storage = self._newest(need)
        if slab is None:
            slab, storage = self._new_slab(need)
        offset = slab.used
        slab.used += need
        self._remaining = max(self._remaining - need, 0)
        view = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (nbytes,), (1,))
        return view.view(dtype)

    def tail_bytes(self) -> int:
        """Bytes of live slabs that no request uses: what the slabs waste."""
        return locked(self._lock, lambda: sum(s.tail for s in self._slabs if s.storage() is not None))

    # -- internals --------------------------------------------------------------------------
    def _newest(self, need: int) -> tuple[Slab | None, torch.UntypedStorage | None]:
        """The newest slab, when it is alive and ``need`` fits in its tail."""
        self._slabs = [slab for slab in self._slabs if slab.storage() is not None]  # the dead are gone
        if not self._slabs:
            return None, None
        slab = self._slabs[-1]
        storage = slab.storage()
        if storage is None or need > slab.tail:
            return None, None
        return slab, storage

    def withdraw(self, nbytes: int) -> None:
        """``nbytes`` of the expected requests will not come (their homes went pageable)."""
        locked(self._lock, self._withdraw, nbytes)

    def _withdraw(self, nbytes: int) -> None:
        self._remaining = max(self._remaining - nbytes, 0)

    def close(self) -> None:
        """Unregister the registered slabs still alive (``disable``: a caller may hold a view)."""
        if self.registered is not None:
            self.registered.close()

    def _size(self, need: int) -> int:
        """The next slab's size: see the module docstring."""
        left = self._remaining or self.slab_bytes  # beyond those expected: slabs of the usual size
        if self.registered is not None:
            return page_round(max(min(self.slab_bytes, left), need))
        if self.backend.pinned_allocation_size(need) > self.backend.pinned_chunk_bytes:
            raise torch.OutOfMemoryError(
                f"a pinned buffer of {need} bytes is larger than the largest pinned allocation of "
                f"{self.backend.name} ({self.backend.pinned_chunk_bytes} bytes)")
        size = self._cached_size(need, left)
        if size > self.backend.pinned_chunk_bytes:  # a rounded block beyond the chunk: the request alone
            size = self.backend.pinned_allocation_size(need)
        return size

    def _cached_size(self, need: int, left: int) -> int:
        """The next slab's size from a caching host allocator that rounds ``pinned_allocation_size``."""
        if need and self.backend.pinned_allocation_size(need) == need:
            return need  # allocated without rounding: a slab would only hold its memory longer
        target = max(min(self.slab_bytes, left), need)
        block = self.backend.pinned_allocation_size(target)
        if block == target or block <= left or block - target <= self.largest:
            return block  # exact, or a rounded block whose slack later requests will use
        below = block // 2
        if below >= need and self.backend.pinned_allocation_size(below) == below:
            return below
        return block

    def _pin(self, size: int) -> torch.Tensor:
        if self.registered is not None:
            return self.registered.allocate(size)
        return self.backend.empty_pinned(size, torch.uint8)

    def _real(self, size: int) -> int:
        """Pinned bytes a slab of ``size`` really takes."""
        return page_round(size) if self.registered is not None else self.backend.pinned_allocation_size(size)

    def _new_slab(self, need: int) -> tuple[Slab, torch.UntypedStorage]:
        size = self._size(need)
        try:
            tensor = self._pin(size)
        except torch.OutOfMemoryError:
            smallest = self._real(need)
            if size <= smallest:
                raise
            # A full slab is over a pinned limit that the request alone may fit under.
            logger.debug("a %d-byte pinned slab does not fit; trying %d bytes", size, smallest)
            size = smallest
            tensor = self._pin(size)
        storage = tensor.untyped_storage()
        real = self._real(size)
        self._live[weakref.ref(storage, self._live.pop)] = real  # one statement: counted, or never seen
        slab = Slab(weakref.ref(storage), size)
        self._slabs.append(slab)
        return slab, storage

    def __repr__(self) -> str:
        return f"<SlabAllocator {self.live_slabs} slabs, {self.live_bytes} pinned bytes>"
