"""The device abstraction every strategy is written against.

Strategies never touch a vendor module: they allocate, copy, order and gather through a
:class:`DeviceBackend`. The interface mirrors the CUDA stream model (streams are FIFO queues of
device work, events mark a point in a stream, ``wait`` makes another stream's later work start
after that point), because every accelerator we target exposes that model, and because a CPU
simulator of it (the fake backend) can then test the strategies faithfully.

Vocabulary used in the method docs below:

* *enqueue* — the call returns once the work is queued on a stream; it has not necessarily run.
* *host-blocking* — the calling thread waits.
* the *current stream* is the stream selected by :meth:`DeviceBackend.use_stream`, else the
  device's default stream. On every backend, plain torch operations issued by the caller
  (a module's forward) run on the current stream.
"""

from __future__ import annotations

import abc
import contextlib
from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

import torch

__all__ = ["DeviceBackend", "Event", "Stream", "Waitable", "Capability"]


class Capability:
    """Names a backend may list in ``capabilities`` for features the library uses. Each one
    promises the methods named below. (Features of a simulated device that only tests ask for,
    chaos mode or a race sanitizer, are :class:`offload_core.testing.capabilities.SimulatorCapability`.)"""

    #: ``all_gather_into_tensor`` and ``init_process_group`` work across processes
    COLLECTIVES = "collectives"
    #: ``new_event(timing=True)`` gives an event with ``elapsed_time(end)``: the milliseconds
    #: between the points two recorded events mark on the device (``torch.Event(enable_timing=True)``);
    #: :class:`offload_core.common.timeline.Timeline` then times spans on the device, not on the host
    TIMING = "timing"
    #: ``register_host`` / ``unregister_host`` page-lock existing page-aligned host memory at its
    #: exact size (``cudaHostRegister``). Offload-core then pins homes and the bounce ring that
    #: way, registered in pieces of at most ``pinned_chunk_bytes``, rather than through the caching
    #: host allocator, which rounds every request up to a power of two
    HOST_REGISTER = "host_register"
    #: ``empty_host_cache`` gives the host allocator's cached free pinned blocks back to the system
    #: (and ``pinned_memory_allocated`` drops by them); without it they stay cached and counted.
    #: Accelerator backends list it where their torch has a call for their device that works there
    #: (a vendor backend names its own; CUDA's private call is unsupported on Ascend)
    HOST_CACHE = "host_cache"


@runtime_checkable
class Stream(Protocol):
    """A FIFO queue of device work. Work on one stream runs in the order it was enqueued."""

    def synchronize(self) -> None:
        """Host-blocking: return once all work enqueued so far on this stream has run."""

    def query(self) -> bool:
        """True when all work enqueued so far on this stream has run; never blocks."""


@runtime_checkable
class Waitable(Protocol):
    """Something a stream or the host can wait for: an event, or an asynchronous collective."""

    def wait(self, stream: Stream | None = None) -> None:
        """Enqueue on ``stream`` (default: the current stream) a wait for this point: work
        enqueued on that stream afterwards starts only once this point has been reached.
        Never host-blocking on an accelerator."""

    def synchronize(self) -> None:
        """Host-blocking: return once this point has been reached."""

    def query(self) -> bool:
        """True once this point has been reached; never blocks."""


@runtime_checkable
class Event(Waitable, Protocol):
    """A marker in a stream. Recording it again moves the marker; waits enqueued before the
    new record keep waiting for the old point."""

    def record(self, stream: Stream | None = None) -> None:
        """Enqueue the marker on ``stream`` (default: the current stream). The event is
        reached when all work enqueued on that stream before the record has run."""


class DeviceBackend(abc.ABC):
    """One kind of device, as seen by the offloading strategies.

    Subclasses set the class attributes and implement every abstract method. A backend is
    registered through the ``offload_core_register_backends`` hook (see :mod:`offload_core.device.hookspecs`)
    and instantiated by :func:`offload_core.get_backend`, with keyword options the subclass
    documents. ``probe()`` must be cheap and initialise nothing, because it is called on every
    registered backend at the first auto-detection or listing of a process (once: the answer is
    kept), possibly before the process forks.
    """

    #: the name users pass to ``get_backend`` and ``--backend``
    name: ClassVar[str]
    #: torch device type of the tensors this backend allocates ("cuda", "npu", "cpu", ...)
    device_type: ClassVar[str]
    #: torch.distributed backend used for collectives ("nccl", "hccl", "gloo", ...)
    dist_backend: ClassVar[str] = "gloo"
    #: larger wins during auto-detection, within the same tier (see ``plugins.select``)
    priority: ClassVar[int] = 0
    #: True for real hardware; False for simulators, which auto-detection picks last
    is_accelerator: ClassVar[bool] = True
    #: optional features, names from :class:`Capability`
    capabilities: ClassVar[frozenset[str]] = frozenset({Capability.COLLECTIVES})
    #: the largest pinned allocation (or registration) offload-core asks for at once: drivers
    #: refuse a single huge one (above ~200 GB on Ascend), so slabs and registrations are cut to it
    pinned_chunk_bytes: ClassVar[int] = 4 * 2**30
    #: False where pinned memory is not charged to the process's memory cgroup (driver DMA memory
    #: on Ascend): the "auto" host budget then takes this backend's pinned bytes from the cgroup's
    #: headroom itself (see :mod:`offload_core.hostmem.machine`)
    pinned_in_cgroup: ClassVar[bool] = True
    #: stream contexts this backend has entered so far (see :meth:`batch`), where it counts them
    #: (the accelerator base and the fake do); None where it does not
    stream_switches: int | None = None

    # -- identity ---------------------------------------------------------------------------
    @classmethod
    @abc.abstractmethod
    def probe(cls) -> bool:
        """True when this backend can run in this process. Cheap; initialises no device context."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why ``probe()`` is false, in words a user can act on (``offload-core backends`` shows
        it). Same rules as ``probe()``: cheap, initialises nothing. The default says nothing."""
        return None

    @abc.abstractmethod
    def device(self, index: int | None = None) -> torch.device:
        """The torch device tensors are allocated on (``index`` None: the current device)."""

    @abc.abstractmethod
    def device_count(self) -> int:
        """How many devices of this kind this process can use."""

    def bind_thread(self, device: torch.device) -> None:
        """Make ``device`` the current device of the calling thread. Offload-core calls it first
        on each thread it starts (the stager), with the device of the thread that enabled
        offloading: a device runtime keeps the current device per thread, and a new thread
        starts on device 0, where its work would create a context on a rank bound elsewhere.
        The default does nothing (a backend with one device)."""

    # -- streams ----------------------------------------------------------------------------
    @abc.abstractmethod
    def new_stream(self) -> Stream:
        """A new stream, independent of the default stream."""

    @abc.abstractmethod
    def current_stream(self) -> Stream:
        """The stream that plain torch operations of the caller are issued to right now."""

    @abc.abstractmethod
    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager[Stream]:
        """Context manager making ``stream`` the current stream inside the block."""

    def batch(self, stream: Stream) -> contextlib.AbstractContextManager[Stream]:
        """Context manager for several pieces of work queued on ``stream`` together (a block's
        copies, one per dtype, its gathers, the event recorded after them, the blocks prefetched
        with it), under one stream context: inside the block ``stream`` is the current stream,
        and this backend's calls that name ``stream`` (``copy_async``, ``all_gather_into_tensor``
        and waits on the waitable it returns, ``use_stream``) do not select it again.

        Why: selecting a stream costs on some devices (vLLM-Omni measured about 1 ms per switch on
        Ascend 910B), and a call that selects its stream on every copy pays it per copy. The
        strategies enter at most one batch per block and direction. Only the backend's own calls
        and host work (filling a bounce buffer, waiting for an event) belong inside, never
        compute or allocations: a caching allocator ties memory allocated inside to ``stream``.
        Event ``record(stream)`` and ``wait(stream)`` with an explicit stream select nothing.

        The default is :meth:`use_stream`: correct on every backend, and all a backend needs
        whose ``use_stream`` selects nothing for the stream it selected last on the calling
        thread (the accelerator base and the fake do that); a backend whose calls select their
        stream in another way overrides this."""
        return self.use_stream(stream)

    @abc.abstractmethod
    def wait_stream(self, waiter: Stream, waitee: Stream) -> None:
        """Enqueue on ``waiter`` a wait for all work enqueued on ``waitee`` so far."""

    @abc.abstractmethod
    def synchronize(self) -> None:
        """Host-blocking: return once all work on all of this backend's streams has run."""

    # -- events -----------------------------------------------------------------------------
    @abc.abstractmethod
    def new_event(self, timing: bool = False) -> Event:
        """A new, unrecorded event. Waiting on an unrecorded event does not wait. ``timing=True``
        is only passed to backends with :data:`Capability.TIMING` (see there)."""

    # -- host memory ------------------------------------------------------------------------
    @abc.abstractmethod
    def empty_pinned(self, size: int | Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Uninitialised page-locked host memory that ``copy_async`` can read and write
        asynchronously. ``size`` is a number of elements or a shape."""

    @abc.abstractmethod
    def is_pinned(self, tensor: torch.Tensor) -> bool:
        """True if ``tensor`` lives in page-locked host memory usable for async copies."""

    @abc.abstractmethod
    def pinned_memory_allocated(self) -> int:
        """Bytes of pinned host memory this backend really holds for the allocations it handed
        out: the host allocator's rounding included, and freed blocks it still caches until
        :meth:`empty_host_cache`."""

    def pinned_allocation_size(self, nbytes: int) -> int:
        """Bytes an ``empty_pinned`` of ``nbytes`` really takes (the host allocator's rounding).

        Offload-core sizes its pinned slabs with it, so that no rounding is wasted: a slab is
        either a size the allocator hands out exactly, or the whole rounded block. The default,
        no rounding, is right for a backend that pins memory at exact size (host registration)."""
        return nbytes

    def register_host(self, ptr: int, nbytes: int) -> None:
        """Page-lock the host memory ``[ptr, ptr + nbytes)`` (page-aligned, at most
        ``pinned_chunk_bytes``) for asynchronous copies, at its exact size; counted by
        :meth:`pinned_memory_allocated` until :meth:`unregister_host`. Only backends with
        :data:`Capability.HOST_REGISTER`. Raises ``torch.OutOfMemoryError`` when the runtime refuses
        (a driver or ``memlock`` limit): offload-core then gives the rest of the homes pageable memory."""
        raise NotImplementedError(f"{self.name} cannot register host memory")

    def unregister_host(self, ptr: int) -> None:
        """Undo the :meth:`register_host` of the range starting at ``ptr``; the memory stays valid,
        pageable. Only backends with :data:`Capability.HOST_REGISTER`."""
        raise NotImplementedError(f"{self.name} cannot register host memory")

    def empty_host_cache(self) -> None:
        """Return freed pinned blocks that the host allocator caches to the system, where the
        backend lists :data:`Capability.HOST_CACHE`; elsewhere it does nothing. Called when
        offloading is disabled. The default does nothing (no cache)."""

    # -- device memory ----------------------------------------------------------------------
    @abc.abstractmethod
    def empty_device(self, size: int | Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Uninitialised device memory. Raises ``torch.OutOfMemoryError`` when it does not fit."""

    @abc.abstractmethod
    def memory_allocated(self) -> int:
        """Bytes of device memory held by live tensors right now."""

    @abc.abstractmethod
    def max_memory_allocated(self) -> int:
        """Peak of ``memory_allocated`` since start or the last ``reset_peak_memory_stats``."""

    @abc.abstractmethod
    def reset_peak_memory_stats(self) -> None:
        """Restart peak tracking from the current ``memory_allocated``."""

    @abc.abstractmethod
    def mem_get_info(self) -> tuple[int, int]:
        """(free bytes, total bytes) of the device.

        *Free* means the bytes available to new allocations through this backend right now: what
        the driver reports free plus what the backend's caching allocator holds without using
        (reserved but not allocated), so ``free = total - allocated - memory held elsewhere``.
        Strategies decide whether a prefetch fits from it. A raw driver figure, which counts the
        caching allocator's idle reserve as used, would refuse prefetches that fit."""

    # -- transfers --------------------------------------------------------------------------
    @abc.abstractmethod
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None) -> None:
        """Enqueue on ``stream`` (default: current) a copy of ``src`` into ``dst`` (same shape
        and dtype; host to device or device to host, the host side pinned). Neither tensor may
        be touched until an event recorded after the copy has been reached: the caller keeps
        both alive until then."""

    # -- collectives ------------------------------------------------------------------------
    @abc.abstractmethod
    def init_process_group(self, rank: int, world_size: int, init_method: str, **kwargs: Any) -> None:
        """Join the default process group with this backend's ``dist_backend`` and bind this
        rank to its device. ``timeout=`` (a ``datetime.timedelta`` or seconds) bounds the wait
        of every collective; without it torch's default for ``dist_backend`` applies. Other
        keyword arguments go to ``torch.distributed.init_process_group``."""

    @abc.abstractmethod
    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Any = None,
        stream: Stream | None = None,
    ) -> Waitable:
        """Enqueue on ``stream`` (default: current) an all-gather of every rank's ``input``
        into ``output`` (world_size * input.numel(), rank order). Returns a waitable that is
        reached when ``output`` is complete."""

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Release threads or handles the backend owns. Idempotent; the default does nothing."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"
