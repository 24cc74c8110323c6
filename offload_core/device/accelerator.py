"""A :class:`DeviceBackend` for any accelerator torch drives through its device-generic API.

CUDA and Ascend NPU expose the same stream model, and torch names it once: the per-device module
returned by ``torch.get_device_module(device_type)`` (``Stream``, ``Event``, ``current_device``,
``set_device``, ``device_count``, ``current_stream``, ``stream``, ``synchronize``,
``memory_allocated``, ``memory_reserved``, ``max_memory_allocated``, ``reset_peak_memory_stats``,
``mem_get_info``). Writing the backend against those names keeps the vendor backends to a probe
and three class attributes, and keeps the core free of any vendor module (a test enforces it).

Streams and events come from the device module's own ``Stream`` and ``Event`` classes, not from
the generic ``torch.Stream(device=...)`` / ``torch.Event(device=...)`` constructors: those need
the device guard to implement stream creation and event synchronisation, which Ascend's guard
does not, and a vendor event's ``record``/``wait`` may accept only the vendor's own stream type
(Ascend's do). So every stream and event this backend hands out, the current stream included,
is of the device module's classes; the generic classes are the fallback for a device module
that has none.

Lifetime rule inherited from the ABC: ``copy_async`` and ``all_gather_into_tensor`` do not call
``record_stream``; the caller keeps every tensor alive until an event recorded after the work has
been reached, which is also what makes freeing it safe with a caching allocator.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Any, Callable, ClassVar, Sequence

import torch

from ..base.errors import BackendUnavailableError
from . import collectives
from .backend import Capability, DeviceBackend, Event, Stream
from .memory_accounting import AllocationTracker, HostRegistrations, as_shape, power_of_two_ceil

__all__ = ["AcceleratorBackend", "BackendUnavailableError", "CollectiveWork"]

logger = logging.getLogger(__name__)


class CollectiveWork:
    """The :class:`~offload_core.Waitable` of a collective issued with ``async_op=True``.

    NCCL and HCCL run a collective on an internal stream that first waits for the issuing
    stream; ``Work.wait()`` makes the *current* stream wait for the collective without blocking
    the host. So ``wait(stream)`` calls it with ``stream`` made current, and ``synchronize()``
    polls completion instead of waiting on a stream, which would add an ordering edge to a
    stream the caller did not name.
    """

    def __init__(self, backend: AcceleratorBackend, work: Any, *tensors: torch.Tensor) -> None:
        self._backend = backend
        self._work = work
        self._tensors = tensors  # the collective reads and writes them until it completes

    def wait(self, stream: Stream | None = None) -> None:
        stream = stream if stream is not None else self._backend.current_stream()
        with self._backend.use_stream(stream):
            self._work.wait()

    def query(self) -> bool:
        return bool(self._work.is_completed())

    def synchronize(self) -> None:
        delay = 0.0
        while not self._work.is_completed():
            time.sleep(delay)
            delay = min(delay * 2 or 1e-5, 1e-3)
        # Completed, so this orders nothing; it re-raises an error the collective ended with.
        self.wait()


class AcceleratorBackend(DeviceBackend):
    """Streams, events, memory, copies and collectives through torch's device-generic API.

    A subclass sets ``name``, ``device_type`` and ``dist_backend`` and implements ``probe()``
    (cheap, initialising nothing) and, ideally, ``unavailable_reason()``. Constructing a backend
    whose probe is false raises :class:`BackendUnavailableError`.

    The *current device* (``device()`` with no index) is the device module's current device,
    read at each call, so work follows ``set_device`` as it does in plain torch code;
    :meth:`init_process_group` sets it to ``rank % device_count()``.
    """

    capabilities = frozenset({Capability.COLLECTIVES, Capability.TIMING})
    #: Pass ``device_id`` to ``init_process_group``: NCCL then binds its communicator to that
    #: device eagerly. Backends whose collective library binds to the current device instead
    #: (HCCL) turn this off.
    bind_device_id: ClassVar[bool] = True

    @classmethod
    def unavailable_reason(cls) -> str:
        """Why ``probe()`` is false, in words a user can act on (shown by ``offload-core backends``)."""
        return f"no {cls.device_type} device is visible to this process"

    def __init__(self) -> None:
        cls = type(self)
        if not cls.probe():
            raise BackendUnavailableError(
                f"offload backend {cls.name!r} cannot be used in this process: {cls.unavailable_reason()}"
            )
        self._mod = self._device_module()
        # The device module's own classes where it has both (see the module docstring).
        self._vendor_streams = hasattr(self._mod, "Stream") and hasattr(self._mod, "Event")
        # torch's caching host allocator rounds every pinned request up to a power of two and
        # caches freed blocks until emptied; the tracker counts what it really holds.
        self._pinned = AllocationTracker(
            f"{cls.name} pinned host memory", block_size=power_of_two_ceil, caches_freed=True
        )
        self._registered = HostRegistrations()  # Capability.HOST_REGISTER: ranges the runtime pinned
        self._used_devices: set[int] = set()
        self._local = threading.local()
        self.stream_switches = 0
        if self.host_cache_emptier() is not None:  # what this torch has for this device, once
            self.capabilities = cls.capabilities | {Capability.HOST_CACHE}

    def _device_module(self) -> Any:
        """The torch device module; a method so that a backend can supply a different one."""
        return torch.get_device_module(self.device_type)

    # -- identity -------------------------------------------------------------------------
    def device(self, index: int | None = None) -> torch.device:
        if index is None:
            index = int(self._mod.current_device())
        else:
            count = self.device_count()
            if not 0 <= index < count:
                raise ValueError(f"{self.device_type} device index {index} is out of range: {count} device(s) visible")
        self._used_devices.add(index)
        return torch.device(self.device_type, index)

    def device_count(self) -> int:
        return int(self._mod.device_count())

    def bind_thread(self, device: torch.device) -> None:
        self._mod.set_device(device.index if device.index is not None else int(self._mod.current_device()))

    # -- streams --------------------------------------------------------------------------
    def new_stream(self) -> Stream:
        stream_class = self._mod.Stream if self._vendor_streams else torch.Stream
        return stream_class(device=self.device())

    def current_stream(self) -> Stream:
        # Returned as the device module made it: its events accept it as it is.
        return self._mod.current_stream(self.device())

    def use_stream(self, stream: Stream) -> contextlib.AbstractContextManager[Stream]:
        """Selects ``stream`` through the device module, unless it is the stream selected last
        through this backend on this thread: then nothing is selected again, which is how a
        :meth:`batch` queues all its work under one stream context (``copy_async`` and the
        collectives select their stream through here)."""
        return _Selection(self, stream)

    def _selected(self) -> list:
        """The streams selected through this backend on the calling thread, innermost last."""
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def wait_stream(self, waiter: Stream, waitee: Stream) -> None:
        event = self.new_event()
        event.record(waitee)
        event.wait(waiter)

    def synchronize(self) -> None:
        # Only devices this backend used: synchronising a device creates a context on it.
        for index in sorted(self._used_devices | {int(self._mod.current_device())}):
            self._mod.synchronize(index)

    # -- events ---------------------------------------------------------------------------
    def new_event(self, timing: bool = False) -> Event:
        # The device modules' events have the ABC's semantics: record/wait default to the
        # current stream, waiting on or synchronising an unrecorded event returns at once, and
        # re-recording moves the marker without affecting waits already enqueued. They take no
        # device: the event binds to the device of the stream it is first recorded on.
        if self._vendor_streams:
            return self._mod.Event(enable_timing=timing)
        return torch.Event(device=self.device(), enable_timing=timing)

    # -- host memory ----------------------------------------------------------------------
    def empty_pinned(self, size: int | Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        return self._pinned.allocate(size, dtype, _pinned_empty)

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and (tensor.is_pinned() or self._registered.covers(tensor.data_ptr()))

    def pinned_memory_allocated(self) -> int:
        return self._pinned.held + self._registered.bytes

    def register_host(self, ptr: int, nbytes: int) -> None:
        """Through the vendor's runtime call (:meth:`_runtime_register`); counted until unregistered."""
        if Capability.HOST_REGISTER not in self.capabilities:
            return super().register_host(ptr, nbytes)
        self._registered.check(ptr, nbytes)
        self._runtime_register(ptr, nbytes)
        self._registered.add(ptr, nbytes)

    def unregister_host(self, ptr: int) -> None:
        if Capability.HOST_REGISTER not in self.capabilities:
            return super().unregister_host(ptr)
        self._registered.remove(ptr)
        self._runtime_unregister(ptr)

    def _runtime_register(self, ptr: int, nbytes: int) -> None:
        """The vendor runtime's registration call (``cudaHostRegister``); raises
        ``torch.OutOfMemoryError`` when it fails. Backends listing :data:`Capability.HOST_REGISTER`
        implement it and :meth:`_runtime_unregister`."""
        raise NotImplementedError

    def _runtime_unregister(self, ptr: int) -> None:
        raise NotImplementedError

    def pinned_allocation_size(self, nbytes: int) -> int:
        return power_of_two_ceil(nbytes)

    def empty_host_cache(self) -> None:
        """Free the host allocator's cached pinned blocks (see :meth:`host_cache_emptier`). Where
        this torch has no way to, the blocks stay cached and so does the tracker's count of them:
        ``pinned_memory_allocated`` keeps reporting what is really held."""
        empty = self.host_cache_emptier()
        if empty is None:
            logger.debug("%s: this torch (%s) cannot empty the pinned host cache", self.name, torch.__version__)
            return
        empty()
        self._pinned.empty_cache()

    def host_cache_emptier(self) -> Callable[[], None] | None:
        """The call that empties this device's pinned host cache on this torch, or None.

        The generic one is ``torch.accelerator.empty_host_cache`` (newer torch only), and only
        when this device is torch's current accelerator: it empties that accelerator's host
        allocator. A vendor backend overrides this with its device's own name for the call,
        falling back to this one."""
        accelerator = getattr(torch, "accelerator", None)
        empty = getattr(accelerator, "empty_host_cache", None)
        if empty is None or not hasattr(accelerator, "current_accelerator"):
            return None
        current = accelerator.current_accelerator()
        return empty if current is not None and current.type == self.device_type else None

    # -- device memory --------------------------------------------------------------------
    def empty_device(self, size: int | Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        device = self.device()
        try:
            return torch.empty(as_shape(size), dtype=dtype, device=device)
        except torch.OutOfMemoryError:
            raise
        except RuntimeError as exc:
            # Some vendor allocators still raise a bare RuntimeError; callers catch one type.
            if "out of memory" in str(exc).lower():
                raise torch.OutOfMemoryError(str(exc)) from exc
            raise

    def memory_allocated(self) -> int:
        return int(self._mod.memory_allocated(self.device()))

    def max_memory_allocated(self) -> int:
        return int(self._mod.max_memory_allocated(self.device()))

    def reset_peak_memory_stats(self) -> None:
        self._mod.reset_peak_memory_stats(self.device())

    def mem_get_info(self) -> tuple[int, int]:
        # The driver counts the caching allocator's idle reserve as used; new allocations through
        # the backend get it first, so it is free in the ABC's sense.
        device = self.device()
        free, total = self._mod.mem_get_info(device)
        idle = int(self._mod.memory_reserved(device)) - int(self._mod.memory_allocated(device))
        return int(free) + max(idle, 0), int(total)

    # -- transfers ------------------------------------------------------------------------
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: Stream | None = None) -> None:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"copy_async needs equal shapes and dtypes, got dst {tuple(dst.shape)} {dst.dtype} "
                f"and src {tuple(src.shape)} {src.dtype}"
            )
        if self.device_type not in (dst.device.type, src.device.type):
            # Neither side on the device: torch would copy on the host, synchronously and outside
            # every stream, so events recorded after it would not order anything.
            raise ValueError(
                f"copy_async moves bytes to or from a {self.device_type} device, "
                f"got dst on {dst.device} and src on {src.device}"
            )
        stream = stream if stream is not None else self.current_stream()
        with self.use_stream(stream):
            # Asynchronous only when the host side is pinned; from pageable memory the driver
            # stages the copy and the call returns late, but the result is still correct.
            dst.copy_(src, non_blocking=True)

    # -- collectives ----------------------------------------------------------------------
    def init_process_group(self, rank: int, world_size: int, init_method: str, **kwargs: Any) -> None:
        count = self.device_count()
        if count < 1:
            raise RuntimeError(f"no {self.device_type} device is visible to rank {rank}")
        index = rank % count
        # Before the group exists: the collective library binds its communicator to the
        # current device, and a rank left on device 0 would share it with rank 0.
        self._mod.set_device(index)
        self._used_devices.add(index)
        if self.bind_device_id:
            kwargs.setdefault("device_id", torch.device(self.device_type, index))
        collectives.init_process_group(self.dist_backend, rank, world_size, init_method, **kwargs)

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Any = None,
        stream: Stream | None = None,
    ) -> CollectiveWork:
        stream = stream if stream is not None else self.current_stream()
        with self.use_stream(stream):
            work = collectives.all_gather(output, input, group=group, async_op=True)
        return CollectiveWork(self, work, output, input)


class _Selection:
    """``use_stream``'s context (a class, not a generator: entered for every block)."""

    __slots__ = ("_backend", "_stream", "_context")

    def __init__(self, backend: AcceleratorBackend, stream: Stream) -> None:
        self._backend, self._stream, self._context = backend, stream, None

    def __enter__(self) -> Stream:
        backend, stream = self._backend, self._stream
        stack = backend._selected()
        if not stack or stack[-1] is not stream:
            # The device module's context manager keeps the previous stream in a fresh object per
            # use. ``with stream:`` keeps it on the stream object itself, which is not re-entrant in
            # every torch we support and is shared by all threads using that stream.
            self._context = backend._mod.stream(stream)
            self._context.__enter__()
            backend.stream_switches += 1
        stack.append(stream)
        return stream

    def __exit__(self, *exc: Any) -> None:
        self._backend._selected().pop()
        if self._context is not None:
            self._context.__exit__(*exc)


def _pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)
