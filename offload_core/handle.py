"""OffloadHandle: what ``enable_offload`` returns, and the only way to undo it."""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
from typing import Any, Iterator, Protocol, Sequence

import torch
from torch import nn

from .common import changes
from .device.backend import Capability, DeviceBackend
from .hostmem.machine import Trimmer, size_text as _size
from .base.locks import locked
from .common.timeline import Timeline

logger = logging.getLogger(__name__)

HANDLE_ATTRIBUTE = "_offload_core_handle"


class OffloadHandle:
    """Live offloading of one target. ``disable()`` restores ordinary host tensors.

    One lock per handle serialises everything that touches its model: forwards of the model and of
    its blocks or components, pipeline calls, ``disable()``, copies. A second thread calling the
    same offloaded model waits for the first call to finish."""

    def __init__(self, target: Any, config: Any, backend: DeviceBackend, baseline: int = 0, plan: Any = None,
                 replan: Any = None) -> None:
        self.target = target
        self.config = config
        self._plan = plan
        # measured activations -> the plan made with them, once: after the first pipeline call
        self._replan = replan
        self.strategy = plan.strategy if plan is not None else config.strategy
        self.backend = backend
        self.lock = threading.RLock()
        self._baseline = baseline  # device bytes other users of the backend held before enable
        self._peak = 0  # the backend's peak before its counter was last restarted (restart_peak)
        self.parts: list = []
        self.switch: Any = None  # the parts' phase switch (strategies/phases.py), when some park
        self.placement: Any = None  # where the weights' host homes are (hostmem.placement)
        self._placements: list = []  # more, made when a part was packed again (see place())
        self._installs: list[Install] = []
        self.enabled = False

    def open(self, parts: Sequence[Any], placement: Any, installs: Sequence["Install"], switch: Any = None) -> None:
        """The last step of ``enable``: the handle takes its enabled ``parts``, the ``placement``
        of their homes, the ``installs`` put on the target (installed already) and the phase
        ``switch`` of its parts (None: nothing parks), and is enabled. ``disable()`` undoes the
        installs in reverse order after the parts."""
        self.parts = list(parts)
        self.placement = placement
        self._installs = list(installs)
        self.switch = switch
        self.enabled = True

    @property
    def plan(self) -> Any:
        """What was decided (``print(handle.plan)``): per component resident, streamed, staged or
        swapped, its resident blocks, the device and host bytes (pinned, pageable, disk) it is
        expected to take and the bytes copied per forward, with the activation bytes each
        streamed or swapped component's first call measured, and the device peaks they make; once a
        pipeline call ran, the phases that call had (``observed_phases``). The planner's plan under a device budget;
        without one, the plan of what the strategy flag set up (``budget`` None)."""
        measured = {name: used for p in self.parts for name, used in p.measured_activations().items()}
        plan = self._plan.measured(measured)
        if self.switch is not None and self.switch.observed is not None:
            plan = plan.observed(*self.switch.observed)
        return plan

    @property
    def device_weight_bytes(self) -> int:
        return sum(p.device_weight_bytes for p in self.parts)

    def stats(self) -> dict[str, int]:
        """Transfer and memory figures since enable.

        ``device_peak_bytes`` is the backend's peak allocation since enable, less what other users
        of the backend held before it; ``device_weight_bytes`` the device memory the strategy
        itself holds at most. Host side: ``pinned_host_bytes`` (weights in pinned memory, and the
        bounce ring), ``pageable_host_bytes`` (weights in ordinary memory), ``disk_bytes``
        (weights read from disk), ``bounce_bytes`` (the ring), ``staged_bytes`` (bytes copied
        through the ring so far), ``disk_read_bytes`` and ``disk_read_seconds`` (bytes read from
        checkpoint or spill files so far, and the stager's time in those reads); ``host_bytes``
        is the weights held in RAM. ``switch_h2d_bytes``: of ``h2d_bytes``, what parked components
        loaded back when their phase began (``handle.plan``'s phases).
        """
        totals = {"h2d_bytes": 0, "h2d_copies": 0, "prefetch_misses": 0, "loads": 0, "retired_slot_bytes": 0,
                  "switch_h2d_bytes": 0}
        for part in self.parts:
            for key, value in part.counters.as_dict().items():
                totals[key] = totals.get(key, 0) + value
        totals["device_peak_bytes"] = max(max(self._peak, self.backend.max_memory_allocated()) - self._baseline, 0)
        totals["device_weight_bytes"] = self.device_weight_bytes
        for placement in (self.placement, *self._placements):
            for key, value in placement.stats().items():
                totals[key] = totals.get(key, 0) + value
        totals["host_bytes"] = sum(p.host_bytes for p in self.parts) - totals["disk_bytes"]
        return totals

    def describe(self) -> list[dict[str, Any]]:
        """What each part of the handle (one per streamed model, one for the resident modules, one
        for model-level groups) holds now, as plain data for tools and tests that would otherwise
        reach into the strategies: ``part`` (what it covers), ``streamed_blocks`` and
        ``kept_blocks`` (block names: copied in per forward, or kept on the device), ``slots`` and
        ``slot_bytes`` (the device ring streamed blocks are copied into, one slot's bytes),
        ``resident_bytes`` (what a streamed part keeps on the device besides its slots),
        ``device_weight_bytes`` and ``host_bytes``. Block and slot keys are empty or 0 for parts
        that stream no blocks. Read live: after a re-pack it shows the new layout."""
        return [{"part": part.describe(), "streamed_blocks": list(getattr(part, "block_names", ())),
                 "kept_blocks": list(getattr(part, "kept_names", ())), "slots": getattr(part, "num_slots", 0),
                 "slot_bytes": getattr(part, "slot_bytes", 0), "resident_bytes": getattr(part, "resident_bytes", 0),
                 "device_weight_bytes": part.device_weight_bytes, "host_bytes": part.host_bytes}
                for part in self.parts]

    @contextlib.contextmanager
    def measured_call(self) -> Iterator[None]:
        """Around a pipeline call. Until the budget has been planned again from a first call, the
        call is traced (where the backend times device work and no trace of the user's is on), so
        that each streamed block's compute time is known; when it ends, :meth:`call_ended`."""
        timeline = None
        timed = Capability.TIMING in self.backend.capabilities
        if self._replan is not None and timed and all(p.timeline is None for p in self.parts):
            timeline = Timeline(self.backend)
            for part in self.parts:
                part.timeline = timeline
        try:
            yield
        finally:
            if timeline is not None:
                for part in self.parts:
                    part.timeline = None
                timeline.close()
            self.call_ended(timeline)

    def call_ended(self, timeline: Timeline | None = None) -> None:
        """A pipeline call ended. After the first, the budget is planned again with the activations
        it measured, the blocks' compute times ``timeline`` shows and the phases it had, and the
        streamed components whose kept blocks change take the new layout as they next begin (one
        log line says what changed and why)."""
        if self._replan is None:
            return
        replan, self._replan = self._replan, None
        measured = {name: used for p in self.parts for name, used in p.measured_activations().items()}
        if not measured:
            return
        timed = timings(timeline) if timeline is not None else ({}, None)
        seen = self.switch.observed if self.switch is not None else None
        parking = self.switch.parking() if self.switch is not None else set()
        new = replan(measured, *timed, seen, parking)
        if self.switch is not None:
            self.switch.follow(new)
        changes = []
        for part in self.parts:
            label = getattr(part, "label", None)
            if label not in parking:
                continue
            before, after = self._plan.component(label), new.component(label)
            if after.mode == before.mode and after.resident_blocks != before.resident_blocks:
                part.relayout(after.resident_blocks)
                block = f", a block computing in {timed[0][label] * 1e3:.3g} ms" if label in timed[0] else ""
                changes.append(f"{label} keeps {len(after.resident_blocks)} of {after.n_blocks} blocks (was "
                               f"{len(before.resident_blocks)}): activations measured {_size(measured.get(label, 0))}, "
                               f"{_size(before.activation_bytes)} planned{block}")
        self._plan = new
        logger.info("re-planned after the first call: %s", "; ".join(changes) if changes else "no layout changes")

    def restart_peak(self) -> None:
        """The backend's peak counter starts again from what is allocated now, so that a part can
        measure what one call takes (its first: activations); the peak before is kept here."""
        self._peak = max(self._peak, self.backend.max_memory_allocated())
        self.backend.reset_peak_memory_stats()

    @contextlib.contextmanager
    def trace(self) -> Iterator[Timeline]:
        """Record what the strategies do inside the block (per-block compute, copies, waits,
        misses) into a :class:`~offload_core.common.timeline.Timeline`, closed on exit so that its spans
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
        if not locked(self.lock, self._disable):
            return
        trimmer = Trimmer()
        trimmer.add(sum(p.host_bytes for p in self.parts))  # the homes just freed, device buffers on CPU backends
        trimmer.flush()
        logger.info("offload (%s) disabled on %s", self.strategy, type(self.target).__name__)

    @torch.inference_mode(False)
    def _disable(self) -> bool:
        """``disable``'s steps (the caller holds the lock); False if it was done already."""
        if not self.enabled:
            return False
        if self.switch is not None:
            self.switch.close()  # first: a part disabled is parked by nobody
        for part in reversed(self.parts):
            part.disable()
        while self._installs:
            self._installs[-1].uninstall()
            self._installs.pop()
        for placement in (self.placement, *self._placements):
            placement.close()
        changes.unregister(self)  # before the flag: an interrupt in between leaves a disable to finish
        self.enabled = False
        # no reference cycle left (part -> handle, install -> handle): what the strategies still
        # hold goes now, not at the next garbage collection
        for part in self.parts:
            part.handle = part.switch = None
        return True

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

    # -- what the parts ask of the handle ----------------------------------------------------
    def place(self, part: Any, txn: Any) -> None:
        """Homes for a part packed again (its units are new): placed under the handle's options,
        for that part alone. A part that had the handle's placement to itself gives it up."""
        from .hostmem.placement import place_homes

        placement = place_homes([part], self.config, self.backend)
        placement.attach([part], txn)
        if self.parts == [part] and not self._placements:
            old, self.placement = self.placement, placement
            old.close()
        else:
            self._placements.append(placement)

    def plain_copy(self, obj: Any, memo: dict) -> Any:
        """``copy.deepcopy(obj)`` as if offloading were off: an ordinary copy, not offloaded, whose
        tensors are host tensors with the true values (also what pickling an offloaded model
        stores)."""
        return locked(self.lock, self._plain_copy, obj, memo)

    def _plain_copy(self, obj: Any, memo: dict) -> Any:
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
        self._installed(False)
        try:
            return copy.deepcopy(obj, memo)
        finally:
            self._installed(True)

    def _installed(self, on: bool) -> None:
        """Take off (False) or put back (True) everything offloading put on the model: the parts'
        call wrappers and the target's installs."""
        for part in self.parts:
            if part.enabled:
                part.instrumented(on)
        for install in self._installs:
            install.install() if on else install.uninstall()

    def __repr__(self) -> str:
        state = "enabled" if self.enabled else "disabled"
        return f"<OffloadHandle {self.strategy} on {type(self.target).__name__} via {self.backend.name}: {state}>"


def timings(timeline: Timeline) -> tuple[dict[str, float], float | None]:
    """From a traced call: per streamed component, the median compute time of its blocks (spans
    named "<component>.<block>"), and the host-to-device bytes per second its copies ran at."""
    times: dict[str, list[float]] = {}
    copied = seconds = 0.0
    for span in timeline.spans():
        if span.kind == "compute" and "." in span.name:
            times.setdefault(span.name.split(".", 1)[0], []).append(span.seconds)
        elif span.kind == "copy":
            copied, seconds = copied + span.nbytes, seconds + span.seconds
    rate = copied / seconds if copied and seconds > 0 else None
    return {name: sorted(values)[len(values) // 2] for name, values in times.items()}, rate


class Install(Protocol):
    """Something ``enable`` puts on the target itself (not on a part's modules): the handle mark,
    a pipeline's subclass. Taken off while a plain copy is made, so the copy is not offloaded,
    and by ``disable()``; both calls may be repeated."""

    def install(self) -> None: ...

    def uninstall(self) -> None: ...
