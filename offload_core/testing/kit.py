"""Helpers for the conformance kit: moving known values through a backend and reading them back.

Everything here goes through the :class:`offload_core.DeviceBackend` API; the only torch
operations are on host tensors and on the current stream, so the helpers hold for any backend.
"""

from __future__ import annotations

import contextlib
import gc
import socket
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from offload_core import DeviceBackend, get_backend
from offload_core.testing.capabilities import SimulatorCapability

#: allocators may round a request up (CUDA rounds to 512 bytes); accounting checks allow this much
ALLOC_SLACK = 4096
#: how long a "slow" operation takes at least, in seconds, where the backend models bandwidth
SLOW_SECONDS = 0.3
#: bytes of the slow operation where the backend has no bandwidth model: big enough that a real
#: link (tens of GB/s) is still busy long after the host has queued the next few calls
BIG_COPY_BYTES = 256 << 20
#: a hang guard, not a synchronisation: a correct backend finishes far sooner
HANG_SECONDS = 30.0


def host(backend: DeviceBackend, values: torch.Tensor) -> torch.Tensor:
    """A pinned host tensor holding ``values``."""
    pinned = backend.empty_pinned(tuple(values.shape), values.dtype)
    pinned.copy_(values)
    return pinned


def upload(backend: DeviceBackend, values: torch.Tensor) -> torch.Tensor:
    """A device tensor holding ``values``, complete when this returns."""
    src = host(backend, values)
    dst = backend.empty_device(tuple(values.shape), values.dtype)
    stream = backend.current_stream()
    backend.copy_async(dst, src, stream)
    stream.synchronize()
    return dst


def download(backend: DeviceBackend, tensor: torch.Tensor) -> torch.Tensor:
    """The values of a device tensor as an ordinary host tensor, after the current stream's work."""
    out = backend.empty_pinned(tuple(tensor.shape), tensor.dtype)
    stream = backend.current_stream()
    backend.copy_async(out, tensor, stream)
    stream.synchronize()
    return out.clone()


def pattern(i: int, n: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A vector unique to iteration ``i``, so a stale or half-written copy is never mistaken for it."""
    return (torch.arange(n, dtype=torch.float64) + i * n).to(dtype)


def sample(shape: Sequence[int], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Random host values of ``dtype`` (bool: both values present, so a poisoned all-True fails)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, tuple(shape), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(tuple(shape), generator=g, dtype=torch.float32).to(dtype)
    return torch.randint(-1000, 1000, tuple(shape), generator=g, dtype=torch.int64).to(dtype)


def mismatches(outs: Sequence[torch.Tensor], expected: Callable[[int], torch.Tensor]) -> list[int]:
    """Indices ``i`` where ``outs[i]`` is not exactly ``expected(i)``."""
    return [i for i, out in enumerate(outs) if not torch.equal(out, expected(i))]


def check_compute_sees_side_copy(backend: DeviceBackend, order: Callable[[Any], None], size: int = 256) -> None:
    """Copy onto a side stream, ``order(side)`` the current stream after it, then compute on the
    current stream: the result must see the copied values, every time."""
    side = backend.new_stream()
    for i in range(8):
        src = host(backend, pattern(i, size))
        dev = backend.empty_device(size, torch.float32)
        backend.copy_async(dev, src, side)
        order(side)
        result = dev * 2 + 1  # a torch op on the current stream
        assert torch.equal(download(backend, result), pattern(i, size) * 2 + 1), f"iteration {i}"


def finishes_within(fn: Callable[[], Any], seconds: float = HANG_SECONDS) -> bool:
    """Run ``fn`` on a helper thread; False if it is still running after ``seconds`` (a hang).

    Used where a broken backend would block forever, so the kit reports a failure instead of
    hanging. A hung helper thread is a daemon and is abandoned.
    """
    error: list[BaseException] = []

    def target() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=target, daemon=True, name="offload-core-kit-guard")
    thread.start()
    thread.join(seconds)
    if error:
        raise error[0]
    return not thread.is_alive()


def collect() -> None:
    """Let dead tensors go now (reference cycles included), so accounting can be checked."""
    gc.collect()


class SlowWork:
    """Makes a stream busy for a while: a large host-to-device copy.

    On a backend with :data:`SimulatorCapability.BANDWIDTH` (option ``h2d_bandwidth``) a fresh instance
    with a low bandwidth makes a small copy take :data:`SLOW_SECONDS`; elsewhere the copy is
    :data:`BIG_COPY_BYTES`, which keeps a real link busy for milliseconds, thousands of times
    longer than the host needs to queue and query.
    """

    def __init__(self, backend: DeviceBackend, nbytes: int) -> None:
        self.backend = backend
        self.nbytes = nbytes
        self._src = backend.empty_pinned(nbytes)
        self._src.fill_(7)
        self._dst = backend.empty_device(nbytes)

    def enqueue(self, stream: Any) -> None:
        self.backend.copy_async(self._dst, self._src, stream)


@contextlib.contextmanager
def slow_backend(name: str, backend: DeviceBackend) -> Iterator[SlowWork]:
    """A backend on which :class:`SlowWork` is slow, with that work ready to enqueue."""
    caps = type(backend).capabilities
    if SimulatorCapability.BANDWIDTH in caps:
        nbytes = 1 << 20
        options: dict[str, Any] = {"h2d_bandwidth": nbytes / SLOW_SECONDS}
        if SimulatorCapability.CHAOS in caps:
            options["chaos"] = True
        instance = get_backend(name, **options)
        try:
            yield SlowWork(instance, nbytes)
            instance.synchronize()
        finally:
            instance.close()
    else:
        yield SlowWork(backend, BIG_COPY_BYTES)
        backend.synchronize()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(fn: Callable[..., None], world_size: int, args: tuple, timeout: float = 120.0) -> None:
    """Run ``fn(rank, *args)`` in ``world_size`` spawned processes; raise if any fails or hangs."""
    import torch.multiprocessing as mp

    context = mp.start_processes(fn, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(deadline - time.monotonic(), 0.1)):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"{world_size} ranks did not finish within {timeout:.0f} s")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join()
