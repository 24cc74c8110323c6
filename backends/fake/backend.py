"""The fake backend: a CPU simulator of an accelerator, for testing strategies without one."""

from __future__ import annotations

import collections
import contextlib
import functools
import itertools
import logging
import math
import os
import threading
import weakref
from typing import Any, Sequence

import torch

from offload_core.common.config import check_value, count
from offload_core.device import collectives
from offload_core.device.backend import Capability, DeviceBackend
from offload_core.device.memory_accounting import HostRegistrations, as_shape, power_of_two_ceil
from offload_core.base.locks import locked
from offload_core.testing.capabilities import SimulatorCapability

from .memory import FakeOutOfMemoryError, Pool
from .options import flag, nbytes, option, positive_number, seconds
from .sanitizer import Sanitizer, suspended
from .streams import DefaultStream, FakeEvent, FakeStream, FakeTimingEvent, _Chaos, pause
from .trace import StreamTrace, now_ns

logger = logging.getLogger(__name__)

#: pinned_rounding option -> how the pinned pool counts (see FakeBackend); "register" counts as
#: "exact" and adds host registration
PINNED_ROUNDING: dict[str, dict] = {
    "exact": {},
    "pow2": {"block_size": power_of_two_ceil, "caches_freed": True},
    "register": {},
}


def _rounding(value: Any) -> str:
    """A pinned_rounding model: one of PINNED_ROUNDING's names."""
    if value not in PINNED_ROUNDING:
        raise ValueError(f"choose from {', '.join(PINNED_ROUNDING)}")
    return value


def _chunk(value: Any) -> int:
    """A pinned chunk size: bytes > 0."""
    chunk = nbytes(value)
    if chunk <= 0:
        raise ValueError("must be > 0 bytes")
    return chunk


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _poison(t: torch.Tensor) -> None:
    """Fill a copy destination with a value no correct computation produces."""
    try:
        if t.dtype.is_floating_point or t.dtype.is_complex:
            t.fill_(float("nan"))
        elif t.dtype == torch.bool:
            t.fill_(True)
        else:
            t.fill_(torch.iinfo(t.dtype).max)
    except (TypeError, RuntimeError):  # dtypes without arithmetic (bits, packed 4-bit floats): every bit set
        t.view(torch.uint8).fill_(0xFF)


class FakeBackend(DeviceBackend):
    """Streams as threads, real overlap, events, memory accounting, chaos mode, bandwidth model.

    Options (keyword arguments, else environment variables, parsed alike: ``chaos`` takes True or
    False, or 1/0, true/false, yes/no, on/off; a value that does not parse is an
    :class:`~offload_core.OffloadConfigError` naming the keyword or the variable):

    * ``chaos`` (``OFFLOAD_CORE_FAKE_CHAOS=1``): every queued task starts after a random delay of
      ``chaos_delay`` / 2 .. ``chaos_delay`` seconds (default 2 ms), and every copy (or gather)
      destination holds NaN (integers: their maximum) from the moment the copy is enqueued until
      it has run, so reading it without waiting gives wrong numbers every time. Exception: while a
      queued read of that memory has not run yet, the poison waits until the copy's stream reaches
      the copy, so that a read correctly ordered before the copy (through an event) still sees the
      old contents, as on a GPU.
    * ``device_memory`` (``OFFLOAD_CORE_FAKE_DEVICE_MEMORY``, bytes): capacity; exceeding it raises
      :class:`FakeOutOfMemoryError`, a ``torch.OutOfMemoryError``.
    * ``pinned_memory`` (``OFFLOAD_CORE_FAKE_PINNED_MEMORY``, bytes): cap on pinned host memory.
    * ``pinned_rounding`` (``OFFLOAD_CORE_FAKE_PINNED_ROUNDING``): ``"exact"`` (default) or
      ``"pow2"``, which models torch's caching host allocator in the pinned accounting: every
      request takes the next power of two, and a freed block stays held (and counted) until
      :meth:`empty_host_cache`, reused meanwhile by requests of the same block size. ``"register"``
      models a runtime that registers host memory (:data:`~offload_core.Capability.HOST_REGISTER`,
      ``cudaHostRegister``): ``register_host`` pins exactly the bytes asked, refuses memory that is
      not page-aligned or already registered, and counts against ``pinned_memory`` with
      ``empty_pinned``'s allocations; ``empty_pinned`` stays exact.
    * ``pinned_chunk_bytes`` (``OFFLOAD_CORE_FAKE_PINNED_CHUNK_BYTES``, default 4 GiB): the largest
      single pinned allocation or registration the fake "driver" accepts; a larger one raises
      :class:`FakeOutOfMemoryError`, as real drivers refuse a single huge pinned allocation.
    * ``device_cache`` (``OFFLOAD_CORE_FAKE_DEVICE_CACHE=1``): models a caching device allocator
      that keeps a reserve: device memory once allocated stays reserved after it is freed (the
      fake's "driver" sees it as used) until :meth:`empty_cache`; new allocations reuse it, so
      ``mem_get_info`` counts it as free, as the ABC defines free.
    * ``h2d_bandwidth`` (``OFFLOAD_CORE_FAKE_H2D_BANDWIDTH``, bytes/s): a host-to-device copy of
      n bytes takes at least n / bandwidth seconds, like a PCIe link.
    * ``sanitize`` (``OFFLOAD_CORE_FAKE_SANITIZE=1``; on by default under ``pytest --backend=fake``):
      the race sanitizer (:mod:`offload_core_fake.sanitizer`). Every access to this backend's device
      and pinned memory — copies, gathers, and the torch operations the host issues, seen through
      a ``TorchDispatchMode`` — is checked against the order a GPU would give the streams that
      issued it, the default stream treated as asynchronous; an unordered conflicting pair, or a
      buffer dropped while work touching it may still run, raises :class:`StreamRaceError`.
    * ``seed``: the chaos delays' random seed.
    * ``inline_copy_bytes`` (default 256 KiB): without chaos and without a bandwidth model, a copy
      of at most this many bytes onto an idle stream runs at once on the calling thread. Waking a
      Python worker thread costs two GIL handoffs, tens of microseconds that no real device's
      ``copy_async`` costs; large copies still run on the stream's thread and overlap compute.

    Compute (torch operations issued by the caller) always runs on the calling thread, which is
    the default stream; side streams run only the backend's own work (copies, waits, collectives).
    """

    name = "fake"
    device_type = "cpu"
    dist_backend = "gloo"
    priority = 0
    is_accelerator = False
    capabilities = frozenset(
        {
            SimulatorCapability.CHAOS, SimulatorCapability.CAPACITY, SimulatorCapability.BANDWIDTH,
            SimulatorCapability.TRACE, SimulatorCapability.SANITIZE, Capability.COLLECTIVES, Capability.TIMING,
            Capability.HOST_CACHE,
        }
    )

    def __init__(
        self,
        *,
        chaos: bool | None = None,
        chaos_delay: float = 0.002,
        device_memory: int | None = None,
        pinned_memory: int | None = None,
        pinned_rounding: str | None = None,
        pinned_chunk_bytes: int | None = None,
        device_cache: bool | None = None,
        h2d_bandwidth: float | None = None,
        seed: int = 0,
        inline_copy_bytes: int = 256 * 1024,
        sanitize: bool | None = None,
    ) -> None:
        # Each option: the keyword, else its environment variable (see .options)
        chaos = option("chaos", chaos, flag) or False
        sanitize = option("sanitize", sanitize, flag) or False
        device_memory = option("device_memory", device_memory, nbytes)
        pinned_memory = option("pinned_memory", pinned_memory, nbytes)
        pinned_rounding = option("pinned_rounding", pinned_rounding, _rounding) or "exact"
        pinned_chunk_bytes = option("pinned_chunk_bytes", pinned_chunk_bytes, _chunk)
        device_cache = option("device_cache", device_cache, flag) or False
        h2d_bandwidth = option("h2d_bandwidth", h2d_bandwidth, positive_number)
        chaos_delay = check_value("chaos_delay", chaos_delay, seconds)
        seed = check_value("seed", seed, count(0))
        inline_copy_bytes = check_value("inline_copy_bytes", inline_copy_bytes, count(0))
        self.chaos = chaos
        self.h2d_bandwidth = h2d_bandwidth
        self.inline_copy_bytes = inline_copy_bytes
        self.timeline = StreamTrace()
        self._chaos = _Chaos(chaos_delay, seed) if self.chaos else None
        self._device = Pool("device", device_memory)
        self._pinned = Pool("pinned host memory", pinned_memory, **PINNED_ROUNDING[pinned_rounding])
        self.pinned_rounding = pinned_rounding
        self._registered = HostRegistrations()
        if pinned_rounding == "register":
            self.capabilities = type(self).capabilities | {Capability.HOST_REGISTER}
        if pinned_chunk_bytes is not None:
            self.pinned_chunk_bytes = pinned_chunk_bytes
        self.device_cache = device_cache
        self._reserved = 0  # device_cache: bytes the fake allocator holds (allocated or idle)
        self._local = threading.local()
        #: the stream contexts an accelerator would have entered for the work asked of this backend
        #: so far: every ``use_stream`` and ``batch`` not nested in one on the same stream, and every
        #: ``copy_async``, ``all_gather_into_tensor`` and wait on a gather's waitable outside one on
        #: its stream (the accelerator base enters one for each of them)
        self.stream_switches = 0
        self.bound_threads: list[tuple[str, torch.device]] = []  # bind_thread calls: (thread name, device)
        self.sanitizer = Sanitizer(self.current_stream) if sanitize else None
        self._default = DefaultStream(self.timeline, self.sanitizer)
        self._streams: weakref.WeakSet[FakeStream] = weakref.WeakSet()
        self._ids = itertools.count(1)
        # chaos: storage -> reads of it queued on streams that have not run yet (see _poisoner)
        self._pending_reads: collections.Counter[int] = collections.Counter()
        self._reads_lock = threading.Lock()

    # -- identity -------------------------------------------------------------------------
    @classmethod
    def probe(cls) -> bool:
        return True

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return os.cpu_count() or 1

    def bind_thread(self, device: torch.device) -> None:
        """Recorded, with the calling thread's name, so that tests can see which threads bound."""
        self.bound_threads.append((threading.current_thread().name, device))

    # -- streams --------------------------------------------------------------------------
    def new_stream(self) -> FakeStream:
        stream = FakeStream(f"stream-{next(self._ids)}", self.timeline, self._chaos, self.sanitizer)
        self._streams.add(stream)
        return stream

    def _stack(self) -> list:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def current_stream(self) -> FakeStream | DefaultStream:
        stack = getattr(self._local, "stack", None)  # asked twice per streamed block: no helper call
        return stack[-1] if stack else self._default

    def use_stream(self, stream: FakeStream | DefaultStream) -> contextlib.AbstractContextManager:
        """Counted in ``stream_switches`` unless ``stream`` is the one selected last on this thread
        (then an accelerator selects nothing: see :meth:`DeviceBackend.batch`)."""
        return _Selection(self, stream)

    batch = use_stream  # the ABC's default, without its extra call: entered for every block

    def _switch(self, stream: FakeStream | DefaultStream) -> None:
        """Count the stream context an accelerator enters for a call that names ``stream``."""
        stack = getattr(self._local, "stack", None)
        if not stack or stack[-1] is not stream:
            self.stream_switches += 1

    def wait_stream(self, waiter: FakeStream | DefaultStream, waitee: FakeStream | DefaultStream) -> None:
        event = self.new_event()
        event.record(waitee)
        event.wait(waiter)

    def synchronize(self) -> None:
        streams = list(self._streams)
        for stream in streams:
            stream.synchronize()
        if self.sanitizer is not None:
            self.sanitizer.on_synchronize_all([self._default, *streams])

    # -- events ---------------------------------------------------------------------------
    def new_event(self, timing: bool = False) -> FakeEvent:
        if timing:
            return FakeTimingEvent(self.current_stream, self.timeline, self.sanitizer)
        return FakeEvent(self.current_stream, self.timeline, self.sanitizer)

    # -- memory ---------------------------------------------------------------------------
    def empty_pinned(self, size: int | Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        self._check_pinned(self._pinned.block_size(math.prod(as_shape(size)) * dtype.itemsize), "allocation")
        tensor = self._pinned.allocate(size, dtype)
        if self.sanitizer is not None:
            self.sanitizer.track(tensor, "pinned")
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return self._pinned.owns(tensor) or (tensor.is_cpu and self._registered.covers(tensor.data_ptr()))

    def pinned_memory_allocated(self) -> int:
        return self._pinned.held + self._registered.bytes

    def register_host(self, ptr: int, nbytes: int) -> None:
        if Capability.HOST_REGISTER not in self.capabilities:
            return super().register_host(ptr, nbytes)
        self._registered.check(ptr, nbytes)
        self._check_pinned(nbytes, "registration")
        self._registered.add(ptr, nbytes)

    def unregister_host(self, ptr: int) -> None:
        if Capability.HOST_REGISTER not in self.capabilities:
            return super().unregister_host(ptr)
        self._registered.remove(ptr)

    def _check_pinned(self, nbytes: int, what: str) -> None:
        """The fake driver's limits: one pinned allocation or registration of at most
        ``pinned_chunk_bytes``, all of them within the ``pinned_memory`` cap."""
        if nbytes > self.pinned_chunk_bytes:
            raise FakeOutOfMemoryError(
                f"fake pinned host memory: a single {what} of {nbytes} bytes is above the driver's limit of "
                f"{self.pinned_chunk_bytes} bytes")
        cap, held = self._pinned.capacity, self.pinned_memory_allocated()
        # (the pool checks its own allocations; registered bytes count against the same cap)
        shared = what == "registration" or self._registered.bytes
        if cap is not None and shared and held + nbytes > cap:
            raise FakeOutOfMemoryError(
                f"fake pinned host memory out of memory: tried to pin {nbytes} bytes with {held} of "
                f"{cap} bytes in use")

    def pinned_allocation_size(self, nbytes: int) -> int:
        return self._pinned.block_size(nbytes)

    def empty_host_cache(self) -> None:
        self._pinned.empty_cache()

    def empty_device(self, size: int | Sequence[int], dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        tensor = self._device.allocate(size, dtype)
        if self.device_cache:
            self._reserved = max(self._reserved, self._device.current)
        if self.sanitizer is not None:
            self.sanitizer.track(tensor, "device")
        return tensor

    def memory_allocated(self) -> int:
        return self._device.current

    def max_memory_allocated(self) -> int:
        return self._device.peak

    def reset_peak_memory_stats(self) -> None:
        self._device.reset_peak()

    def mem_get_info(self) -> tuple[int, int]:
        # Computed as on a real device: what the "driver" has not handed to the allocator, plus
        # the allocator's idle reserve, which new allocations reuse.
        total = self._device.capacity
        if total is None:
            total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        reserved = self.memory_reserved()
        driver_free = max(total - reserved, 0)
        return driver_free + reserved - self._device.current, total

    # -- fake-only tools (device_cache) ---------------------------------------------------
    def memory_reserved(self) -> int:
        """Device bytes the fake allocator holds, in use or idle (``device_cache``; else in use)."""
        return max(self._reserved, self._device.current) if self.device_cache else self._device.current

    def empty_cache(self) -> None:
        """Give the idle reserve back to the fake "driver" (``device_cache``)."""
        self._reserved = self._device.current

    # -- transfers ------------------------------------------------------------------------
    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream: FakeStream | DefaultStream | None = None) -> None:
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(
                f"copy_async needs equal shapes and dtypes, got dst {tuple(dst.shape)} {dst.dtype} "
                f"and src {tuple(src.shape)} {src.dtype}"
            )
        stream = stream if stream is not None else self.current_stream()
        stack = getattr(self._local, "stack", None)  # _switch, inlined: once per copy
        if not stack or stack[-1] is not stream:
            self.stream_switches += 1
        nbytes = src.nbytes
        h2d = not self._device.owns(src)
        label = "H2D" if h2d else "D2H"
        if self.sanitizer is not None:
            self.sanitizer.on_copy(dst, src, stream, f"copy_async ({label})")
        bandwidth = self.h2d_bandwidth if h2d else None
        if not self.chaos and bandwidth is None:  # the common path: no simulation to add
            stream.submit(functools.partial(dst.copy_, src), label, nbytes, inline=nbytes <= self.inline_copy_bytes)
            return
        poison = self._poisoner(dst, stream)
        read_done = self._queue_read(src)

        def copy() -> None:
            start = now_ns()
            try:
                dst.copy_(src)
            finally:
                if read_done is not None:
                    read_done()
            if bandwidth:
                remaining = nbytes / bandwidth - (now_ns() - start) / 1e9
                if remaining > 0:
                    pause(remaining)

        stream.submit(copy, label, nbytes, prepare=poison)

    def _poisoner(self, dst: torch.Tensor, stream: FakeStream | DefaultStream):
        """Chaos: poison ``dst`` as early as is legal. Returns the poisoning still to run when the
        stream reaches the write, or None.

        At enqueue time, unless a queued read of ``dst``'s memory has not run yet: that read may be
        correctly ordered before this write (a slot recycled after an event), and must see the old
        contents. Then the poison waits until the stream reaches the write, when everything the
        write is ordered after has run."""
        if not self.chaos:
            return None
        if not locked(self._reads_lock, self._pending_reads.__getitem__, _storage_key(dst)):
            with suspended():  # the backend's own write, part of the copy the sanitizer recorded
                _poison(dst)
            return None
        return lambda: _poison(dst)

    def _queue_read(self, src: torch.Tensor):
        """Chaos: count a queued read of ``src``'s memory; returns the call that marks it done."""
        if not self.chaos:
            return None
        key = _storage_key(src)
        locked(self._reads_lock, self._count_read, key, 1)
        return functools.partial(locked, self._reads_lock, self._count_read, key, -1)

    def _count_read(self, key: tuple[int, int], step: int) -> None:
        """One more (``step`` 1) or one fewer (-1) queued read of storage ``key`` (the reads lock held)."""
        count = self._pending_reads[key] + step
        if count > 0:
            self._pending_reads[key] = count
        else:
            self._pending_reads.pop(key, None)

    # -- collectives ----------------------------------------------------------------------
    def init_process_group(self, rank: int, world_size: int, init_method: str, **kwargs: Any) -> None:
        collectives.init_process_group(self.dist_backend, rank, world_size, init_method, **kwargs)

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        group: Any = None,
        stream: FakeStream | DefaultStream | None = None,
    ) -> FakeEvent:
        stream = stream if stream is not None else self.current_stream()
        self._switch(stream)
        gathered = self.sanitizer.on_collective(output, input, stream) if self.sanitizer is not None else None
        poison = self._poisoner(output, stream)
        read_done = self._queue_read(input)

        def gather() -> None:
            try:
                collectives.all_gather(output, input, group=group)
            finally:
                if read_done is not None:
                    read_done()

        stream.submit(
            gather,
            "all_gather",
            output.numel() * output.element_size(),
            prepare=poison,
        )
        done = self.new_event()
        done.record(stream)
        if gathered is not None:
            done._vc = gathered  # for the sanitizer, the gather is done only where its waitable says
        return _GatherDone(self, done)

    # -- fake-only tools ------------------------------------------------------------------
    def export_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the per-stream timeline (copies, waits, collectives) as Chrome trace JSON."""
        self.timeline.export_chrome_trace(path)

    def close(self) -> None:
        for stream in list(self._streams):
            stream.close()


class _Selection:
    """``use_stream``'s context (a class, not a generator: entered for every block)."""

    __slots__ = ("_backend", "_stream")

    def __init__(self, backend: FakeBackend, stream: FakeStream | DefaultStream) -> None:
        self._backend, self._stream = backend, stream

    def __enter__(self) -> FakeStream | DefaultStream:
        stack, stream = self._backend._stack(), self._stream
        if not stack or stack[-1] is not stream:
            self._backend.stream_switches += 1
        stack.append(stream)
        return stream

    def __exit__(self, *exc: Any) -> None:
        self._backend._stack().pop()


class _GatherDone:
    """A gather's waitable: the backend's event after the gather, waiting on which selects the
    waiting stream, as the accelerator base's collective waitable does (counted in
    ``stream_switches``)."""

    __slots__ = ("_backend", "_event")

    def __init__(self, backend: FakeBackend, event: FakeEvent) -> None:
        self._backend, self._event = backend, event

    def wait(self, stream: FakeStream | DefaultStream | None = None) -> None:
        target = stream if stream is not None else self._backend.current_stream()
        self._backend._switch(target)
        self._event.wait(target)

    def query(self) -> bool:
        return self._event.query()

    def synchronize(self) -> None:
        self._event.synchronize()
