"""Pinned host memory registered with the device runtime, for backends that can
(:data:`offload_core.Capability.HOST_REGISTER`).

The caching host allocator rounds every pinned request up to a power of two (a 20.4 GiB request
pins 32 GiB). Registering ordinary page-aligned memory with the runtime (``cudaHostRegister``)
pins exactly the pages asked for. The memory is an anonymous mapping: page-aligned by
construction, and back to the operating system the moment it is unmapped, without waiting for the
C allocator to trim. It is registered in pieces of at most ``backend.pinned_chunk_bytes``, because
drivers refuse a single huge registration.

A block is unregistered when the last view of it dies, or by :meth:`RegisteredMemory.close`
(``disable``) for blocks a caller still holds: their memory stays valid, pageable.
"""

from __future__ import annotations

import mmap
import weakref

import torch

from ..device.memory_accounting import PAGE_BYTES


def page_round(nbytes: int) -> int:
    """Bytes a registered block of ``nbytes`` takes: whole pages."""
    return -(-nbytes // PAGE_BYTES) * PAGE_BYTES


class RegisteredMemory:
    """Allocates registered blocks on ``backend`` and unregisters them."""

    def __init__(self, backend) -> None:
        self.backend = backend
        # first byte -> (mapping, registered pieces): holding the mapping keeps it mapped until its
        # pieces are unregistered, whatever order the tensor's storage lets go of it in
        self._live: dict[int, tuple[mmap.mmap, list[int]]] = {}

    def allocate(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor of ``page_round(nbytes)`` registered bytes. Raises
        ``torch.OutOfMemoryError`` (nothing left registered) when the runtime refuses a piece."""
        size = page_round(nbytes)
        mapping = mmap.mmap(-1, size)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # the tensor keeps the mapping alive
        base = tensor.data_ptr()
        pieces: list[int] = []
        chunk = max(PAGE_BYTES, self.backend.pinned_chunk_bytes // PAGE_BYTES * PAGE_BYTES)
        try:
            for start in range(0, size, chunk):
                self.backend.register_host(base + start, min(chunk, size - start))
                pieces.append(base + start)
        except BaseException:
            for ptr in pieces:
                self.backend.unregister_host(ptr)
            raise
        self._live[base] = (mapping, pieces)
        weakref.finalize(tensor.untyped_storage(), self._release, base)
        return tensor

    def _release(self, base: int) -> None:
        """Unregister the block at ``base``: its storage died, or :meth:`close`. A finalizer runs
        this wherever a garbage collection happens, so it takes no lock (each step is one atomic
        list or dict operation), and what an interrupt stops is finished by :meth:`close`: a piece
        leaves the list on the line that unregisters it, the entry only once all are done."""
        entry = self._live.get(base)
        if entry is None:  # already released
            return
        pieces = entry[1]
        while pieces:
            self.backend.unregister_host(pieces.pop())
        self._live.pop(base, None)

    @property
    def live_blocks(self) -> int:
        return len(self._live)

    def close(self) -> None:
        """Unregister every block still registered."""
        for base in list(self._live):
            self._release(base)
