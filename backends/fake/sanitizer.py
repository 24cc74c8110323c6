"""Race sanitizer: the ordering a GPU would give, checked on every access to fake device memory.

Why it exists: the fake runs compute eagerly on the calling thread, so work "on the default
stream" is always finished by the time the host issues the next thing. A copy that a GPU would
run while compute still reads its destination (write-after-read) can then never be observed by
running it, chaos mode or not. The sanitizer does not change what runs; it replays the order a
real device guarantees and reports every pair of accesses that order leaves unordered.

The model, as on a GPU (and as PyTorch's CUDA sanitizer models CUDA):

* Every stream, the default (compute) stream included, and the host carry a vector clock.
  Enqueuing work on a stream ticks the stream's own entry and folds in the host's clock (work is
  enqueued after everything the host did before). An event captures a stream's clock at
  ``record``; ``wait`` folds it into the waiting stream; the host learns a stream's or an event's
  clock only by synchronising with it (``synchronize``, a ``query()`` that returned True, the
  backend's ``synchronize``). Work on the default stream is complete only once the host has
  synchronised with it, although the fake executes it eagerly.
* Every access to memory handed out by a sanitized backend (device or pinned) is recorded against
  the stream that issued it, by storage and byte range: ``copy_async`` reads its source and writes
  its destination on its stream, an all-gather reads its input and writes its output, and each torch
  operation the host issues reads its tensor arguments and writes those its schema marks written
  (in-place and ``out=``), on the current stream for device memory and on the host for pinned
  memory. Two accesses to overlapping bytes, one of them a write, from different streams whose
  clocks are unordered are a race: :class:`StreamRaceError`, naming both sides.
* Lifetime: a buffer whose last reference is dropped may be handed to the next allocation of the
  stream it was allocated on (a caching allocator's reuse). Pinned memory from the backend's
  allocator is the exception for copies: CUDA's and torch_npu's caching host allocators record an
  event on the stream of every copy that touches a pinned block and reuse the block only after
  it, so dropping a pinned buffer that a queued ``copy_async`` still reads or writes is safe. Dropping it while work on another
  stream that touches it is neither known finished by the host nor ordered before its allocation
  stream is reported. Accesses that are only ordered before the allocation stream carry over, as
  "ghosts", to the next device allocation on that stream: a copy into the new buffer on a side
  stream must then be ordered after them, or it could overwrite memory a kernel still reads.

Accesses are recorded when they are issued, on the issuing thread, so every report is
deterministic: it does not depend on how the fake's threads happened to be scheduled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import sys
import threading
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode, _pop_mode, _push_mode

from offload_core.common.labels import describe
from offload_core.base.locks import locked

from offload_core.weights.binding import BIND_HOOKS

from .memory import Spans

__all__ = ["Sanitizer", "StreamRaceError", "UnseenWriteError", "paused", "suspended"]


class StreamRaceError(RuntimeError):
    """Two accesses to the same memory that no stream ordering separates, or a buffer dropped
    while work that touches it may still run. The message names both sides."""


# -- clocks ---------------------------------------------------------------------------------


class Clock:
    """The vector clock of one stream (or of the host): what it has done and what it knows of."""

    __slots__ = ("id", "name", "vc")

    def __init__(self, ident: int, name: str) -> None:
        self.id = ident
        self.name = name
        self.vc: dict[int, int] = {}

    def join(self, other: dict[int, int]) -> None:
        vc = self.vc
        for k, v in other.items():
            if vc.get(k, 0) < v:
                vc[k] = v

    def knows(self, stream: int, seq: int) -> bool:
        return self.vc.get(stream, 0) >= seq


@dataclasses.dataclass(frozen=True)
class Site:
    """Who touched memory: everything a report shows about one side of a race."""

    what: str  # "copy_async (H2D)", "aten.mm.default", "all_gather", "host drop", ...
    stream: str
    seq: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    label: str | None
    frames: tuple[tuple[str, int, str], ...]

    def render(self, access: str, start: int, end: int) -> str:
        where = f" in {self.label}" if self.label else ""
        lines = [
            f"{access} by {self.what} on stream {self.stream!r} (op #{self.seq}): tensor {tuple(self.shape)} "
            f"{str(self.dtype).replace('torch.', '')}, bytes [{start}, {end}){where}"
        ]
        lines += [f"        at {file}:{line} in {func}" for file, line, func in self.frames]
        return "\n".join(lines)


@dataclasses.dataclass
class Access:
    start: int
    end: int
    stream: int
    seq: int
    write: bool
    site: Site


@dataclasses.dataclass
class Tracked:
    """A storage handed out by a sanitized backend and the accesses to it not yet retired."""

    sanitizer: Sanitizer
    kind: str  # "device" | "pinned"
    alloc: Clock  # the stream it was allocated on (the host, for pinned memory)
    accesses: list[Access]
    #: id(parameter) -> (first byte, end byte, weak parameter) of offloaded weights showing this memory
    weights: dict[int, tuple[int, int, Any]] = dataclasses.field(default_factory=dict)


class UnseenWriteError(RuntimeError):
    """A write into the device copy of an offloaded parameter that no version counter shows."""


# storage key -> Tracked, for every sanitized backend in the process (one dispatch mode serves all)
_TRACKED: dict[tuple[int, int], Tracked] = {}
# the tracked storages by address, for tensors viewing a slice of one
_SPANS = Spans()
# lifetime reports found in finalizers, where nothing can be raised; raised at the next operation
# or synchronisation of any sanitized backend
_PENDING: list[str] = []
_PENDING_LOCK = threading.Lock()
_local = threading.local()


# storages dropped but not judged yet: (tracked, host clock then, allocation stream's clock then)
_DROPPED: list[tuple[Tracked, dict[int, int], dict[int, int]]] = []


def _settle() -> None:
    """Judge the storages dropped since the last call, then raise every pending report."""
    while _DROPPED:
        try:
            tracked, host, alloc = _DROPPED.pop()
        except IndexError:  # another thread took the last one
            break
        tracked.sanitizer._judge(tracked, host, alloc)
    _raise_pending()


def _raise_pending() -> None:
    message = locked(_PENDING_LOCK, _take_pending)
    if message:
        raise StreamRaceError(message)


def _take_pending() -> str:
    message = "\n".join(_PENDING)
    _PENDING.clear()
    return message


def _key(t: torch.Tensor) -> tuple[int, int]:
    return t.get_device(), t.data_ptr() - t.storage_offset() * t.element_size()


def _find(t: torch.Tensor) -> tuple[Tracked | None, int]:
    """The tracked storage ``t`` views, and where ``t``'s own storage starts inside it (bytes):
    ``t`` may view a storage sliced out of a tracked one (``untyped_storage()[a:b]``, what an
    offloaded weight shows at home), the same memory."""
    try:
        key = _key(t)
    except RuntimeError:  # no memory behind it (torch.export's fake tensors): nothing to track
        return None, 0
    tracked = _TRACKED.get(key)
    if tracked is not None:
        return tracked, 0
    start = _SPANS.find(t.data_ptr())
    if start is None:
        return None, 0
    tracked = _TRACKED.get((key[0], start))
    return tracked, key[1] - start


def _extent_bytes(t: torch.Tensor) -> tuple[int, int]:
    """The byte range of its storage a strided view can touch."""
    size = t.element_size()
    start = t.storage_offset() * size
    if t.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return start, start + (last + 1) * size


_SKIP_DIRS = tuple(
    os.path.dirname(os.path.abspath(p)) + os.sep
    for p in (torch.__file__, __file__, threading.__file__)
)
_STOP_DIRS = tuple(f"{os.sep}{name}{os.sep}" for name in ("_pytest", "pluggy"))  # the test runner below a test


def _frames(limit: int = 3) -> tuple[tuple[str, int, str], ...]:
    """The innermost frames of the issuing Python code, outside torch and this backend."""
    out: list[tuple[str, int, str]] = []
    frame = sys._getframe(2)
    while frame is not None and len(out) < limit:
        code = frame.f_code
        if any(d in code.co_filename for d in _STOP_DIRS):
            break
        if not code.co_filename.startswith(_SKIP_DIRS):
            out.append((_short(code.co_filename), frame.f_lineno, code.co_name))
        frame = frame.f_back
    return tuple(out)


def _short(path: str) -> str:
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path


class suspended:
    """Context manager: the sanitizer ignores torch operations issued by this thread inside it.

    The backend runs its own work (a copy executing inline, chaos poisoning a destination) under
    it: that work was recorded when it was enqueued. Tests that must run without the sanitizer
    (deliberate races, code it cannot follow) use it too."""

    __slots__ = ()

    def __enter__(self) -> None:
        _local.internal = getattr(_local, "internal", 0) + 1

    def __exit__(self, *exc: Any) -> None:
        _local.internal -= 1


class _AccessMode(TorchDispatchMode):
    """Sees every torch operation the host issues and records those that touch tracked memory."""

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # off while torch.compile traces and compiles; on when compiled code runs

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # no per-operation dynamo guard: with the above, dynamo never traces this mode

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (_DROPPED or _PENDING) and not getattr(_local, "internal", 0):
            _settle()  # a buffer dropped too early: say so at the host's very next operation
        if _UNSEEN and not getattr(_local, "internal", 0):
            _report_unseen()
        if _TRACKED and not getattr(_local, "internal", 0):
            hits = _tracked_arguments(func, args, kwargs)
            if hits:
                _record_op(func, hits)
                _UNSEEN.extend(_weights_written(func, hits))
        return func(*args, **kwargs)


#: writes into offloaded weights whose version counter is checked at the next operation:
#: (weak parameter, its version before the write, the report if it did not move)
_UNSEEN: list[tuple[Any, int, str]] = []


def _weights_written(func, hits) -> list[tuple[Any, int, str]]:
    """An entry of :data:`_UNSEEN` for each offloaded weight the op writes."""
    found = []
    for t, write, tracked in hits:
        if not write or not tracked.weights:
            continue
        start, end = _extent_bytes(t)
        shift = _find(t)[1]
        for first, last, ref in tracked.weights.values():
            p = ref()
            if p is not None and first < end + shift and start + shift < last:
                found.append((ref, p._version, _unseen_report(func, t)))
    return found


def _unseen_report(func, t: torch.Tensor) -> str:
    return (
        f"{func} wrote into the device copy of an offloaded weight ({describe(t)}) through a tensor that shares "
        "none of its parameter's version counter (an in-place write through `.data` inside a forward or hook): "
        "offloading cannot see it, and it is lost when the weights go home.\n"
        + "".join(f"        at {f}:{n} in {fn}\n" for f, n, fn in _frames())
        + "  fix: write through the parameter itself under torch.no_grad() (p.mul_(...), p.copy_(...)), or give "
        "it new data (p.data = ...); both are kept"
    )


def _report_unseen() -> None:
    """torch moves the version counter once the op has returned (the parameter's own, or that of
    a ``detach()``-ed alias, which it shares): by the next operation a write the strategy sees has
    moved it; one through ``.data`` has not."""
    entries = _UNSEEN[:]
    del _UNSEEN[:len(entries)]
    for ref, version, report in entries:
        p = ref()
        if p is not None and p._version == version:
            raise UnseenWriteError(report)


#: id(parameter) -> the tracked storage its device view is watched in (see _on_bind)
_BOUND: dict[int, Tracked] = {}


def _on_bind(params, views) -> None:
    """``weights.binding.BIND_HOOKS``: watch parameters while they show device views."""
    if views is None:
        for p in params:
            tracked = _BOUND.pop(id(p), None)
            if tracked is not None:
                tracked.weights.pop(id(p), None)
        return
    if not _TRACKED:
        return
    for p, view in zip(params, views):
        tracked, shift = _find(view)
        if tracked is None or tracked.kind != "device" or not view.numel():
            continue
        start, end = _extent_bytes(view)
        tracked.weights[id(p)] = (start + shift, end + shift, weakref.ref(p))
        _BOUND[id(p)] = tracked


# Ops that read only a tensor's metadata, never its bytes.
_METADATA_ONLY = {
    "empty_like", "new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full", "zeros_like",
    "ones_like", "full_like", "rand_like", "randn_like", "randint_like", "is_pinned", "_has_compatible_shallow_copy_type",
    "is_set_to",
}
_SCHEMA_CACHE: dict[Any, tuple[tuple[bool, ...], dict[str, bool], bool] | None] = {}


def _schema_info(func):
    """(written flag per positional argument, per keyword argument, whether the op is a pure view);
    None for ops that touch no bytes."""
    try:
        return _SCHEMA_CACHE[func]
    except KeyError:
        pass
    schema = func._schema
    if func.overloadpacket.__name__ in _METADATA_ONLY:
        info = None
    else:
        written = tuple(bool(a.alias_info is not None and a.alias_info.is_write) for a in schema.arguments)
        by_name = {a.name: w for a, w in zip(schema.arguments, written)}
        view = not any(written) and any(r.alias_info is not None for r in schema.returns)
        info = None if view else (written, by_name, False)
    _SCHEMA_CACHE[func] = info
    return info


def _tracked_arguments(func, args, kwargs) -> list[tuple[torch.Tensor, bool, Tracked]]:
    info = _schema_info(func)
    if info is None:
        return []
    written, by_name, _ = info
    hits: list[tuple[torch.Tensor, bool, Tracked]] = []
    # no closure here: a recursive inner function is a reference cycle that would keep the
    # tensors in ``hits`` (device buffers) alive until the next garbage collection
    for i, value in enumerate(args):
        _visit(value, written[i] if i < len(written) else False, hits)
    for name, value in kwargs.items():
        _visit(value, by_name.get(name, False), hits)
    return hits


def _visit(value: Any, write: bool, hits: list) -> None:
    if isinstance(value, torch.Tensor):
        values: Iterable[Any] = (value,)
    elif isinstance(value, (list, tuple)):
        values = value
    else:
        return
    for v in values:
        if isinstance(v, torch.Tensor) and v.numel():
            tracked = _find(v)[0]
            if tracked is not None:
                hits.append((v, write, tracked))


def _record_op(func, hits: list[tuple[torch.Tensor, bool, Tracked]]) -> None:
    by_sanitizer: dict[int, list] = {}
    for hit in hits:
        by_sanitizer.setdefault(id(hit[2].sanitizer), []).append(hit)
    frames = _frames()
    for group in by_sanitizer.values():
        group[0][2].sanitizer.on_op(str(func), group, frames, host_sync=func.overloadpacket.__name__ == "_local_scalar_dense")


# -- the sanitizer ----------------------------------------------------------------------------


class Sanitizer:
    """The clocks and access records of one fake backend. Thread-safe: one lock guards all."""

    _ids = itertools.count(1)

    def __init__(self, current_stream) -> None:
        self._current_stream = current_stream
        self._lock = threading.RLock()
        self.host = Clock(0, "host")
        self._ghosts: dict[int, dict[tuple[int, bool], Access]] = {}  # alloc clock -> (stream, write) -> latest
        self._collective_clocks: dict[int, Clock] = {}  # issuing stream's clock id -> the library's stream
        if _on_bind not in BIND_HOOKS:
            BIND_HOOKS.append(_on_bind)
        install()

    # -- clocks ----------------------------------------------------------------------------
    def clock(self, stream: Any) -> Clock:
        """The clock of a stream object of this backend, created on first use."""
        clock = getattr(stream, "_clock", None)
        if clock is None:
            clock = Clock(next(self._ids), getattr(stream, "name", repr(stream)))
            stream._clock = clock
        return clock

    def _tick(self, stream: Any) -> tuple[Clock, int]:
        return self._tick_clock(self.clock(stream))

    def _tick_clock(self, clock: Clock) -> tuple[Clock, int]:
        clock.join(self.host.vc)
        seq = clock.vc.get(clock.id, 0) + 1
        clock.vc[clock.id] = seq
        return clock, seq

    def on_record(self, stream: Any) -> dict[int, int]:
        """An event recorded on ``stream``: the clock it captures."""
        install()
        _settle()
        return locked(self._lock, self._recorded, stream)

    def _recorded(self, stream: Any) -> dict[int, int]:
        clock = self.clock(stream)
        clock.join(self.host.vc)
        return dict(clock.vc)

    def on_wait(self, captured: dict[int, int] | None, stream: Any) -> None:
        install()
        _settle()
        if captured:
            locked(self._lock, self._waited, captured, stream)

    def _waited(self, captured: dict[int, int], stream: Any) -> None:
        self.clock(stream).join(captured)

    def on_host_sync(self, captured: dict[int, int] | None) -> None:
        """The host synchronised with an event (or a stream: pass its clock)."""
        if captured:
            locked(self._lock, self.host.join, captured)
        _settle()

    def on_stream_sync(self, stream: Any) -> None:
        locked(self._lock, self._host_joins, [stream])
        _settle()

    def on_synchronize_all(self, streams: Iterable[Any]) -> None:
        locked(self._lock, self._host_joins, streams)
        _settle()

    def _host_joins(self, streams: Iterable[Any]) -> None:
        for stream in streams:
            self.host.join(self.clock(stream).vc)

    # -- memory ----------------------------------------------------------------------------
    def track(self, tensor: torch.Tensor, kind: str) -> None:
        """Start recording accesses to a fresh allocation (``kind``: "device" or "pinned")."""
        if tensor.numel() == 0:
            return
        install()
        key = _key(tensor)
        nbytes = tensor.untyped_storage().nbytes()
        _settle()
        locked(self._lock, self._track, tensor, kind, key, nbytes)
        weakref.finalize(tensor.untyped_storage(), self._dropped, key)

    def _track(self, tensor: torch.Tensor, kind: str, key: tuple[int, int], nbytes: int) -> None:
        alloc = self.clock(self._current_stream()) if kind == "device" else self.host
        ghosts = self._ghosts.get(alloc.id, {})
        for k in [k for k, a in ghosts.items() if self.host.knows(a.stream, a.seq)]:
            del ghosts[k]
        inherited = [dataclasses.replace(a, start=0, end=nbytes) for a in ghosts.values()]
        _TRACKED[key] = Tracked(self, kind, alloc, inherited)
        _SPANS.add(tensor)

    def _dropped(self, key: tuple[int, int]) -> None:
        """The last reference to a tracked storage is gone. This runs wherever a garbage collection
        happens, on any thread, possibly while that thread holds another lock: so it takes no lock,
        only snapshots the clocks that decide (copying a dict of ints is atomic) and queues the
        storage for :func:`_settle`."""
        tracked = _TRACKED.pop(key, None)
        if tracked is not None:
            _DROPPED.append((tracked, dict(self.host.vc), dict(tracked.alloc.vc)))

    def _judge(self, tracked: Tracked, host: dict[int, int], alloc_vc: dict[int, int]) -> None:
        """A dropped storage, with the clocks of the moment it was dropped: each access not known
        finished either carries over to the allocation stream's next buffer or is reported."""
        locked(self._lock, self._judged, tracked, host, alloc_vc)

    def _judged(self, tracked: Tracked, host: dict[int, int], alloc_vc: dict[int, int]) -> None:
        alloc = tracked.alloc
        ghosts = self._ghosts.setdefault(alloc.id, {})
        for a in tracked.accesses:
            if host.get(a.stream, 0) >= a.seq:
                continue  # finished, as far as the host knew: nothing can race with it
            if tracked.kind == "pinned" and a.site.what.startswith("copy_async"):
                continue  # the pinned allocator records the copy's stream and reuses the block after it
            if alloc is not self.host and alloc_vc.get(a.stream, 0) >= a.seq:
                old = ghosts.get((a.stream, a.write))
                if old is None or old.seq < a.seq:
                    ghosts[(a.stream, a.write)] = a  # the memory's next user must order after it
                continue
            report = (
                f"{tracked.kind} memory was freed (its last reference dropped) while work that touches it "
                f"may still run: on a device the allocator can hand it to the next tensor at once.\n"
                f"  {a.site.render('pending ' + ('write' if a.write else 'read'), a.start, a.end)}\n"
                f"  neither the host nor stream {alloc.name!r} (where it was allocated) is known to have "
                f"waited for that op: synchronize an event recorded after it before dropping the buffer"
            )
            locked(_PENDING_LOCK, _PENDING.append, report)

    # -- accesses --------------------------------------------------------------------------
    def on_collective(self, output: torch.Tensor, input: torch.Tensor, stream: Any) -> dict[int, int]:
        """An all-gather issued on ``stream``. As NCCL and HCCL do, it runs on the library's own
        stream, after the work already on ``stream``; later work on ``stream`` is ordered after
        the gather only through its waitable. Returns the clock that waitable captures."""
        install()
        frames = _frames()
        _settle()
        return locked(self._lock, self._gathered, output, input, stream, frames)

    def _gathered(self, output: torch.Tensor, input: torch.Tensor, stream: Any, frames) -> dict[int, int]:
        issuing = self.clock(stream)
        comm = self._collective_clocks.get(issuing.id)
        if comm is None:
            comm = self._collective_clocks[issuing.id] = Clock(next(self._ids), f"{issuing.name} collectives")
        comm.join(issuing.vc)
        comm, seq = self._tick_clock(comm)
        self._access(input, False, comm, seq, "all_gather", frames)
        self._access(output, True, comm, seq, "all_gather", frames)
        return dict(comm.vc)

    def on_copy(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, what: str) -> None:
        install()
        frames = _frames()
        _settle()
        locked(self._lock, self._copied, dst, src, stream, what, frames)

    def _copied(self, dst: torch.Tensor, src: torch.Tensor, stream: Any, what: str, frames) -> None:
        clock, seq = self._tick(stream)
        self._access(src, False, clock, seq, what, frames)
        self._access(dst, True, clock, seq, what, frames)

    def on_op(self, what: str, hits, frames, host_sync: bool) -> None:
        """A torch operation issued by the host: device memory on the current stream, pinned memory
        on the host itself."""
        _settle()
        locked(self._lock, self._operated, what, hits, frames, host_sync)

    def _operated(self, what: str, hits, frames, host_sync: bool) -> None:
        on_device = [h for h in hits if h[2].kind == "device"]
        if on_device:
            clock, seq = self._tick(self._current_stream())
            for tensor, write, _ in on_device:
                self._access(tensor, write, clock, seq, what, frames)
            if host_sync:
                self.host.join(clock.vc)
        for tensor, write, tracked in hits:
            if tracked.kind != "device":
                self._access(tensor, write, self.host, 0, f"host {what}", frames)

    def _access(self, t: torch.Tensor, write: bool, clock: Clock, seq: int, what: str, frames) -> None:
        """Check an access against the live records of its storage, then record it. Host accesses
        (``clock`` is the host) are checked but not kept: the host is synchronous, and everything
        enqueued after it is ordered after it."""
        if not t.numel():
            return
        tracked, shift = _find(t)
        if tracked is None or tracked.sanitizer is not self:
            return
        start, end = _extent_bytes(t)
        start, end = start + shift, end + shift
        host = self.host
        kept: list[Access] = []
        for a in tracked.accesses:
            if host.knows(a.stream, a.seq):
                continue  # retired: everything enqueued from now on is ordered after it
            overlaps = a.start < end and start < a.end
            ordered = a.stream == clock.id or clock.knows(a.stream, a.seq)
            if overlaps and (write or a.write) and not ordered:
                self._race(tracked, a, write, clock, seq, t, start, end, what, frames)
            # a later access of the same kind covering it, and ordered after it, supersedes it
            if overlaps and ordered and start <= a.start and a.end <= end and (write or not a.write):
                if write or a.stream == clock.id:
                    continue
            kept.append(a)
        if clock is not host:
            site = Site(what, clock.name, seq, tuple(t.shape), t.dtype, describe(t), tuple(frames))
            kept.append(Access(start, end, clock.id, seq, write, site))
        tracked.accesses = kept

    def _race(self, tracked: Tracked, a: Access, write: bool, clock: Clock, seq: int, t, start, end, what, frames) -> None:
        kind = f"{'write' if write else 'read'}-after-{'write' if a.write else 'read'}"
        site = Site(what, clock.name, seq, tuple(t.shape), t.dtype, describe(t), tuple(frames))
        raise StreamRaceError(
            f"{kind} race on fake {tracked.kind} memory: stream {clock.name!r} is not ordered after "
            f"stream {a.site.stream!r}'s op #{a.seq} on overlapping bytes.\n"
            f"  this access:     {site.render('write' if write else 'read', start, end)}\n"
            f"  earlier access:  {a.site.render('write' if a.write else 'read', a.start, a.end)}\n"
            f"  fix: record an event on {a.site.stream!r} after the earlier access and make "
            f"{clock.name!r} wait for it before this one"
        )


# -- installation -----------------------------------------------------------------------------


def watching() -> bool:
    """Whether the access-recording mode is on this thread (else ``suspended`` has nothing to do)."""
    return getattr(_local, "mode", None) is not None


def install() -> None:
    """Put the access-recording dispatch mode on the calling thread's mode stack, once."""
    if getattr(_local, "mode", None) is None:
        mode = _AccessMode()
        mode.__enter__()
        _local.mode = mode


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Take the dispatch mode off this thread's stack for a while (code that refuses to run under
    any dispatch mode, such as some torch.compile paths), and ignore the thread's operations."""
    mode = getattr(_local, "mode", None)
    on_top = mode is not None and _get_current_dispatch_mode() is mode
    if on_top:
        _pop_mode()
        _local.mode = None
    try:
        with suspended():
            yield
    finally:
        if on_top and getattr(_local, "mode", None) is None:
            _push_mode(mode)
            _local.mode = mode
