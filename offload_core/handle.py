"""OffloadHandle: what ``enable_offload`` returns, and the only way to undo it."""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from . import ownership
from .backend import DeviceBackend
from .errors import AlreadyEnabledError, OffloadedModelError
from .hostmem.budget import Trimmer
from .timeline import Timeline

logger = logging.getLogger(__name__)

HANDLE_ATTRIBUTE = "_offload_core_handle"


class OffloadHandle:
    """Live offloading of one target. ``disable()`` restores ordinary host tensors.

    One lock per handle serialises everything that touches its model: forwards of the model and of
    its blocks or components, pipeline calls, ``disable()``, copies. A second thread calling the
    same offloaded model waits for the first call to finish."""

    def __init__(
        self,
        target: Any,
        strategy: str,
        backend: DeviceBackend,
        parts: Sequence[Any] = (),
        baseline: int = 0,
        undo: Sequence = (),
        lock: Any = None,
        placement: Any = None,
        config: Any = None,
    ) -> None:
        self.target = target
        self.strategy = strategy
        self.backend = backend
        self.parts = list(parts)
        self._undo = list(undo)
        self.enabled = True
        self._baseline = baseline  # device bytes other users of the backend held before enable
        self.lock = lock if lock is not None else threading.RLock()
        self._busy = 0  # > 0 while the handle itself re-packs: hooks let its own changes through
        #: pipeline-level instrumentation, taken off while a plain copy is made: set(on: bool)
        self._instruments: list[Callable[[bool], None]] = []
        self.placement = placement  # where the weights' host homes are (hostmem.placement)
        self.config = config
        self._placements: list = []  # more, made when a part was packed again (see place())

    @property
    def device_weight_bytes(self) -> int:
        return sum(p.device_weight_bytes for p in self.parts)

    def stats(self) -> dict[str, int]:
        """Transfer and memory figures since enable.

        ``device_peak_bytes`` is the backend's peak allocation since enable, less what other users
        of the backend held before it; ``device_weight_bytes`` the device memory the strategy
        itself holds at most. Host side: ``pinned_host_bytes`` (weights in pinned memory, and the
        bounce ring), ``pageable_host_bytes`` (weights in ordinary memory), ``disk_bytes``
        (weights read from disk), ``bounce_bytes`` (the ring) and ``staged_bytes`` (bytes copied
        through the ring so far); ``host_bytes`` is the weights held in RAM.
        """
        totals = {"h2d_bytes": 0, "h2d_copies": 0, "prefetch_misses": 0, "loads": 0, "retired_slot_bytes": 0}
        for part in self.parts:
            for key, value in part.counters.as_dict().items():
                totals[key] = totals.get(key, 0) + value
        totals["device_peak_bytes"] = max(self.backend.max_memory_allocated() - self._baseline, 0)
        totals["device_weight_bytes"] = self.device_weight_bytes
        for placement in (self.placement, *self._placements):
            for key, value in placement.stats().items():
                totals[key] = totals.get(key, 0) + value
        totals["host_bytes"] = sum(p.host_bytes for p in self.parts) - totals["disk_bytes"]
        return totals

    @contextlib.contextmanager
    def trace(self) -> Iterator[Timeline]:
        """Record what the strategies do inside the block (per-block compute, copies, waits,
        misses) into a :class:`~offload_core.timeline.Timeline`, closed on exit so that its spans
        can be read. One trace at a time; without one, recording costs nothing."""
        if any(part.timeline is not None for part in self.parts):
            raise RuntimeError("a trace is already recording on this handle")
        timeline = Timeline(self.backend)
        for part in self.parts:
            part.timeline = timeline
        try:
            yield timeline
        finally:
            for part in self.parts:
                part.timeline = None
            timeline.close()

    def disable(self) -> None:
        """Remove every hook, put the weights back in ordinary host tensors, free device memory.

        Calling it again does nothing. If it is interrupted (Ctrl-C, an error), the handle stays
        enabled and calling it again finishes the job: each step is done once. Inside
        ``torch.inference_mode`` too: the tensors given back are ordinary ones."""
        with self.lock, torch.inference_mode(False):
            if not self.enabled:
                return
            for part in reversed(self.parts):
                part.disable()
            while self._undo:
                self._undo[-1]()
                self._undo.pop()
            for placement in (self.placement, *self._placements):
                placement.close()
            self.enabled = False
            ownership.unregister(self)
            # no reference cycle left (part -> handle, instrument -> handle): what the strategies
            # still hold goes now, not at the next garbage collection
            for part in self.parts:
                part.owner = None
            self._instruments.clear()
        trimmer = Trimmer()
        trimmer.add(sum(p.host_bytes for p in self.parts))  # the homes just freed, device buffers on CPU backends
        trimmer.flush()
        logger.info("offload (%s) disabled on %s", self.strategy, type(self.target).__name__)

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """A promise that the weights do not change between forwards while inside: layerwise
        offload then copies the first blocks of the next forward while the previous one ends, so
        those copies overlap whatever runs in between (a scheduler step). Every pipeline call
        without step callbacks runs inside it. Changes the handle can see (new data given to a
        parameter, a replaced buffer, an added module, a dtype change) are still taken in; an
        in-place write through ``.data`` is what the promise excludes."""
        parts = [p for p in self.parts if hasattr(p, "freeze")]
        for part in parts:
            part.freeze()
        try:
            yield
        finally:
            for part in parts:
                part.thaw()

    # -- what users do to the model (routed here by offload_core.ownership) ------------------
    def place(self, part: Any, txn: Any) -> None:
        """Homes for a part packed again (its units are new): planned under the handle's options,
        for that part alone. A part that had the handle's placement to itself gives it up."""
        from .hostmem.placement import plan_placement

        placement = plan_placement([part], self.config, self.backend)
        placement.attach([part], txn)
        if self.parts == [part] and not self._placements:
            old, self.placement = self.placement, placement
            old.close()
        else:
            self._placements.append(placement)

    def refresh(self) -> None:
        """The parts re-packed: record what the handle owns now."""
        ownership.refresh(self)

    def _on_apply(self, part: Any, module: nn.Module, fn: Callable, recurse: bool, original: Callable) -> nn.Module:
        """``module._apply(fn)`` (``.to()``, ``.half()``, ...) on an offloaded module. Moving the
        weights to the backend's device is already true of an offloaded model: nothing to do.
        Moving them anywhere else is refused, before anything changes. A change of dtype, memory
        format or values re-packs the part around the change. Across ranks every change is refused."""
        with self.lock:
            if self._busy or not part.enabled:
                return original(module, fn, recurse)
            tensors = [*module.parameters(recurse=recurse), *module.buffers(recurse=recurse)]
            action, where = classify(fn, tensors, self.backend.device())
            if action == "none" and not is_conversion(fn):
                action = "change"  # it may work in place or depend on values: stand-ins cannot tell
            if action == "none":
                return module
            name = type(module).__name__
            if action == "move":
                raise OffloadedModelError(
                    f"{name}: this would move offloaded weights to {where}; while offloading is on, offload-core "
                    f"keeps them on {self.backend.device()} and in host memory. Call handle.disable() first "
                    f"({self!r}), then move the model"
                )
            if getattr(part, "strategy", None) == "distributed":
                raise OffloadedModelError(
                    f"{name}: changing the dtype or values of a model offloaded across ranks is not supported; call "
                    f"the collective handle.disable() on every rank first ({self!r})"
                )
            logger.info("%s changes dtype or layout while offloaded: packing it again", name)
            part.repack(lambda: original(module, keep_placement(fn), recurse))
            return module

    def plain_copy(self, obj: Any, memo: dict) -> Any:
        """``copy.deepcopy(obj)`` as if offloading were off: an ordinary copy, not offloaded, whose
        tensors are host tensors with the true values (also what pickling an offloaded model
        stores)."""
        with self.lock:
            truths = [t for part in self.parts if part.enabled for t in part.truth()]
            for unit, views, source in truths:
                for entry, view, value in zip(unit.entries, views, unit.plain(source)):
                    for owner in entry.owners:
                        if not owner.bound_to(view):
                            continue  # the user's own tensor: deepcopy copies it as it is
                        if owner.param is not None:
                            memo.setdefault(id(owner.param), nn.Parameter(value, requires_grad=owner.param.requires_grad))
                        else:
                            memo.setdefault(id(view), value)
            self._instrumented(False)
            try:
                return copy.deepcopy(obj, memo)
            finally:
                self._instrumented(True)

    def _instrumented(self, on: bool) -> None:
        for part in self.parts:
            if part.enabled:
                part.instrumented(on)
        for toggle in self._instruments:
            toggle(on)

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"<OffloadHandle {self.strategy} on {type(self.target).__name__} via {self.backend.name}: {state}>"


#: the ``nn.Module`` methods whose ``_apply`` function is a conversion: a new tensor (or the input
#: itself) made from the input's device, dtype and layout alone, so that stand-ins tell what it does
CONVERSIONS = frozenset(
    ("to", "half", "float", "double", "bfloat16", "cuda", "cpu", "type", "xpu", "ipu", "mtia", "to_empty")
)


def is_conversion(fn: Callable) -> bool:
    """True for torch's own conversions (``.to()``, ``.half()``, ``.cuda()`` ...). Any other
    ``_apply`` function (``share_memory()``, ``lambda t: t.mul_(2)``, a library's own) may write in
    place or depend on the values, which stand-ins cannot show: it goes through a re-pack."""
    owner = getattr(fn, "__qualname__", "").split(".<locals>.")[0]
    return getattr(fn, "__module__", None) == nn.Module.__module__ and owner.startswith("Module.") and (
        owner[len("Module."):] in CONVERSIONS
    )


def classify(fn: Callable, tensors: list[torch.Tensor], device: torch.device) -> tuple[str, Any]:
    """What ``fn`` (an ``_apply`` function) would do to ``tensors``, tried on small stand-ins of
    each (device, dtype): ``("none", None)``, ``("move", device)`` to a device other than the
    backend's, or ``("change", None)`` (dtype, memory format or values)."""
    kinds = {(t.device, t.dtype, t.dim() >= 4) for t in tensors}
    change = False
    for where, dtype, four_d in kinds:
        probes = [torch.empty(0, dtype=dtype, device=where)]
        if four_d:
            probes.append(torch.empty((1, 2, 2, 2), dtype=dtype, device=where))
        for probe in probes:
            try:
                out = fn(probe)
            except Exception:  # noqa: BLE001 - not a conversion we can read: re-pack around it
                return "change", None
            if out is probe:
                continue
            if not isinstance(out, torch.Tensor):
                return "change", None
            if out.device != probe.device:
                if out.device != device:
                    return "move", out.device
                if out.dtype == dtype and out.stride() == probe.stride():
                    continue  # onto the backend's device: where an offloaded model already is
            change = True
    return ("change", None) if change else ("none", None)


def keep_placement(fn: Callable) -> Callable:
    """``fn`` without its device move: each result stays where its input was."""

    def apply(t: torch.Tensor) -> torch.Tensor:
        out = fn(t)
        return out.to(t.device) if isinstance(out, torch.Tensor) and out.device != t.device else out

    return apply
