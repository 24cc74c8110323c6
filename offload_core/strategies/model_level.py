"""Model-level offloading: whole component groups swap between host and device.

Each component's weights live in flat host buffers (the same packing as layerwise). At most one
group is *active* on the device; a group becomes active when any of its modules runs. Swapping a
group out re-binds its tensors to their host buffers and drops the device buffers; whatever the
group's forwards changed on the device (buffers updated in place, a replaced buffer, a parameter
edited in place) is copied home first, so nothing is lost. Swapping in is one copy per dtype per
component, from the host as it is then.

Unlike a synchronous swap, the next group (learned from the order groups ran in before, else the
pipeline's declared order) is copied early, on a side stream, whenever the device reports room for
it beside the active group and what that group's compute took on its first call, so the swap
overlaps compute.

Groups stay active for a whole pipeline call and are dropped when it ends; a component called
outside a pipeline call (a bare module, ``pipe.vae.decode(...)``) is dropped when its outermost
forward returns. Between calls every tensor shows its host buffer, the truth.

This module holds the swapping (loads, prefetch, swap-out, what a group's compute takes) of the
groups (model_groups.py). Which calls are running, and so when a group may go home, is
model_calls.py; the device copies that weights autograd saved still reference, and a backward's
read of a released one, are model_saved.py.
"""

from __future__ import annotations

import functools
import logging
from typing import Sequence

import torch
from torch import nn

from ..device.backend import DeviceBackend, Event
from ..hostmem.placement import SWAP, HostUnit
from ..base.locks import locked
from ..planning.peaks import PREFETCH_RESERVE as RESERVE_FRACTION  # of the device, kept free of prefetched weights
from ..common.timeline import UNTRACED
from ..common.transaction import Transaction
from ..weights import WeightUnit
from ..weights.binding import Binding, Home
from ..weights.owners import collect_tensors
from .calls import compile_disabled
from .common import allocate_device, default_placement, pack_units, unpack_units
from .model_calls import ComponentCalls
from .model_groups import Component, Group
from .model_saved import SavedCopies, release_copy
from .part import write_back
from .ring import kept_views, viewed

logger = logging.getLogger(__name__)


class ModelLevelOffload(ComponentCalls, SavedCopies):
    """Swaps named groups of modules; the order hint is the groups' usual order of use. When a
    group goes to the device and home again is decided by its component calls (model_calls.py);
    the device copies saved weights reference live on in model_saved.py."""

    def __init__(
        self,
        groups: Sequence[tuple[str, Sequence[tuple[str, nn.Module]]]],
        backend: DeviceBackend,
        prefetch: bool = True,
        device_limit: int | None = None,
        reserved: dict[str, int] | None = None,
    ) -> None:
        super().__init__(backend)
        self.prefetch = prefetch
        self.device_limit = device_limit  # a device budget: prefetches stay within it, whatever the device has
        # a budget's activation headroom per component: what a group's compute is taken to need until measured
        self.reserved = dict(reserved or {})
        self._spec = [(name, list(members)) for name, members in groups]
        self._form_groups()
        # the group that usually runs next: the declared order first, then what was observed within
        # a call; the last group has none, so nothing is prefetched only to be released at call end
        self._next: dict[int, int | None] = {i: i + 1 for i in range(len(self.groups) - 1)}
        self._active: int | None = None
        self.peak_weight_bytes = 0
        self._activation_bytes: dict[int, int] = {}  # group -> device bytes its calls took beyond its weights
        self._measuring: tuple[int, int] | None = None  # (group, memory allocated when it became active)
        _swaps_run_eagerly()

    def _form_groups(self) -> None:
        """One component per module with weights (a module registered twice counts once), grouped
        as declared; a group left with none is dropped."""
        self.groups: list[Group] = []
        seen: set[int] = set()
        for group_name, members in self._spec:
            components = []
            for name, module in members:
                if id(module) in seen:
                    continue  # one module registered under two names
                seen.add(id(module))
                components.append(Component(name, module, WeightUnit(name, collect_tensors([module]))))
            if components:
                self.groups.append(Group(group_name, components))
        if not self.groups:
            raise ValueError("model-level offload found no module with weights to offload")

    _split_units = _form_groups  # a re-pack (Part.repack) forms the groups again from the modules now

    def host_units(self) -> list:
        """The units whose homes the placement policy decides: each swaps in once per call."""
        return [HostUnit(c.unit, SWAP, c.unit.nbytes) for g in self.groups for c in g.components]

    def describe(self) -> str:
        return ", ".join(c.name for g in self.groups for c in g.components)

    def modules(self) -> list[nn.Module]:
        return [c.module for g in self.groups for c in g.components]

    # -- sizes ----------------------------------------------------------------------------
    @property
    def device_weight_bytes(self) -> int:
        """The most device bytes held by this strategy's weights so far (prefetch included)."""
        return self.peak_weight_bytes

    @property
    def host_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups)

    @property
    def largest_group_bytes(self) -> int:
        return max(g.nbytes for g in self.groups)

    def _device_bytes(self) -> int:
        return sum(g.nbytes for g in self.groups if g.state != "host")

    # -- lifecycle ------------------------------------------------------------------------
    def enable(self, txn: Transaction) -> None:
        self.epoch += 1
        default_placement(self, txn)
        units = [c.unit for g in self.groups for c in g.components]
        pack_units(units, self.placement, txn, "components")
        for c in (c for g in self.groups for c in g.components):
            c.home = Home(c.unit, c.unit.host_views)
        self.copy_stream = self.backend.new_stream()
        for group in self.groups:
            group.ready = self.backend.new_event()
        # each undo registered before its step: an interrupt inside the step is undone too
        txn.on_rollback(self._remove_hooks)
        self._instrument()
        txn.on_rollback(lambda: setattr(self, "enabled", False))
        self.enabled = True
        logger.info(
            "model-level offload: %s",
            ", ".join(f"{g.name} ({g.nbytes / 2**20:.1f} MB)" for g in self.groups),
        )

    def truth(self) -> list:
        self._settle()
        return [(c.unit, c.unit.host_views, c.unit.host) for g in self.groups for c in g.components]

    def disable(self) -> None:
        locked(self.lock, self._disable)

    def _disable(self) -> None:
        self._remove_hooks()
        if not self.enabled:
            return
        self._settle()
        components = [c for g in self.groups for c in g.components]
        for c in components:
            c.home = None  # it references the home, which goes as soon as its unit is unpacked
            release_copy(c)  # a graph kept without a backward holds no device memory past disable
        unpack_units([c.unit for c in components], self.placement)
        self.enabled = False

    def _settle(self) -> None:
        """Every group home (changes on the device copied back), no copy in flight (swapping a
        group out waits for its copies)."""
        self.placement.drain()
        self.release_all()

    def release_all(self) -> None:
        """Swap every group out (end of a pipeline call), keeping the learned order."""
        self._stop_measuring()
        if self.timeline is not None:
            self.timeline.end_compute(self.backend.current_stream())
        self._active = None
        for group in self.groups:
            self._swap_out(group)

    # -- swapping -------------------------------------------------------------------------
    def _before_use(self, index: int) -> None:
        if self._active == index:
            return
        if self.switch is not None:
            for c in self.groups[index].components:
                self.switch.entering(c.name)
        self._stop_measuring()
        if self.timeline is not None:  # the active group's compute has all been issued
            self.timeline.end_compute(self.backend.current_stream())
        previous, self._active = self._active, None
        for i, group in enumerate(self.groups):
            if i != index and group.state != "host":
                self._swap_out(group)
        group = self.groups[index]
        if group.state != "host" and any(c.binding is None for c in group.components):
            self._swap_out(group)  # one an interrupt tore (its components home, its state not yet)
        if group.state == "loading" and not all(c.home.at_home() for c in group.components):
            self._swap_out(group)  # prefetched before a tensor was given new data: its copy is stale
        if group.state == "host":
            self._reconcile(group)
            group = self.groups[index]  # re-packing makes new groups
            self._load(group)
        compute = self.backend.current_stream()
        self._issued(group)
        with UNTRACED if self.timeline is None else self.timeline.compute_after(compute, group.name):
            group.ready.wait(compute)
        for c in group.components:
            c.binding.to_device()
        group.state = "active"
        self._active = index
        self._start_measuring(index)
        if previous is not None:
            self._next[previous] = index
        following = self._next.get(index)
        if self.prefetch and following is not None:
            self._maybe_prefetch(following)

    def _reconcile(self, group: Group) -> None:
        """Before a group goes to the device its tensors must show their host views."""
        self.reconcile((c.unit, c.unit.host_views) for c in group.components if not c.home.at_home())

    def _load(self, group: Group) -> None:
        """Allocate the group's device buffers and queue its copies (one per dtype per component),
        after all compute issued so far: the device buffers freed before may be reused. An
        allocation failure (out of memory) leaves the group on the host, ready to try again. The
        components' previous device copies, which graphs kept without a backward may still
        reference, are released first (``saved_buffers`` reads them again if a backward comes)."""
        for c in group.components:
            release_copy(c)
        buffers = [
            allocate_device(self.backend, c.unit.numel, f"{c.name} on the device ({group.name} group)")
            for c in group.components
        ]
        group.state = "loading"
        freed = self._freed()
        transfers = []
        for c, device in zip(group.components, buffers):
            c.device = device
            c.binding = Binding(c.unit, c.unit.host_views, c.unit.views(device))
            transfers += self.placement.transfers(c.unit, device)
            self.counters.h2d_bytes += c.unit.nbytes
        self.counters.h2d_copies += self.placement.copies(transfers)
        group.ticket = self.placement.run(functools.partial(self._queue_load, group, freed, transfers))
        self.counters.loads += 1
        self.peak_weight_bytes = max(self.peak_weight_bytes, self._device_bytes())

    def _queue_load(self, group: Group, freed: Event, transfers: list) -> None:
        """Queue a group's copies after ``freed`` and its ready event after them (at once, or on
        the stager thread when some component is staged)."""
        stream = self.copy_stream
        group.recorded = False  # until ready is recorded after the copies: an interrupt may stop it short
        with self.backend.batch(stream):  # one stream context for the whole group
            freed.wait(stream)
            try:
                issue = functools.partial(self.placement.issue, transfers, stream)
                if self.timeline is None:
                    issue()
                else:
                    self.timeline.copy(stream, group.name, group.nbytes, issue)
            finally:  # also after a failure half-way: swapping the group out waits for what was queued
                group.ready.record(stream)
                group.recorded = True

    def _issued(self, group: Group) -> None:
        """Block until the stager has queued ``group``'s load, so its ready event is recorded."""
        ticket, group.ticket = group.ticket, None
        self.placement.wait(ticket)

    def _freed(self) -> Event:
        """An event after all compute issued so far: buffers freed before it may be reused."""
        event = self.backend.new_event()
        event.record(self.backend.current_stream())
        return event

    def _maybe_prefetch(self, index: int) -> None:
        group = self.groups[index]
        if index == self._active or group.state != "host":
            return
        needed = self._activation_bytes.get(self._active)
        if needed is None:  # the active group's first call: what the budget's plan reserved, if anything
            reserved = [self.reserved[c.name] for c in self.groups[self._active].components if c.name in self.reserved]
            if not reserved:
                return
            needed = max(reserved)
        free, total = self.backend.mem_get_info()
        if self.device_limit is not None:
            free, total = min(free, self.device_limit - self.backend.memory_allocated()), self.device_limit
        if group.nbytes <= free - max(RESERVE_FRACTION * total, needed):
            logger.debug("prefetching %s while %s computes", group.name, self.groups[self._active].name)
            try:
                self._load(group)
            except torch.OutOfMemoryError:  # only an optimisation: the group loads when it is used
                logger.debug("no room to prefetch %s after all", group.name)

    def measured_activations(self) -> dict[str, int]:
        return {c.name: used for index, used in self._activation_bytes.items() for c in self.groups[index].components}

    def _start_measuring(self, index: int) -> None:
        """On a group's first use, note the device memory allocated with its weights in place, so
        that what its compute takes on top (activations, a VAE decode's buffers) is known before
        anything is prefetched beside it."""
        if index not in self._activation_bytes:
            self._measuring = (index, self.peak_from_here())

    def _stop_measuring(self) -> None:
        """The measured group stops being active: all its compute has been issued, so the peak
        since it started bounds what it takes (from above: an earlier, higher peak counts too)."""
        if self._measuring is not None:
            index, start = self._measuring
            self._activation_bytes[index] = max(self.backend.max_memory_allocated() - start, 0)
            self._measuring = None

    def _swap_out(self, group: Group) -> None:
        if group.state == "host":
            return
        # its copies read the host buffers, which the user may write once the group is home:
        # the host waits for them (long finished when the group was in use; cheap either way)
        self._issued(group)
        still_loading = group.state == "loading" and self.timeline is not None  # worth a trace instant
        with self.timeline.host_wait(f"unload {group.name} (still loading)") if still_loading else UNTRACED:
            # a load interrupted before its ready event was recorded: the whole copy stream
            (group.ready if group.recorded else self.copy_stream).synchronize()
        for c in group.components:
            # a component already home (a swap-out interrupted half-way, done again) has no binding
            active = group.state == "active" and c.binding is not None
            if active and c.binding.to_home(functools.partial(self._write_back, c.name)):
                self.dirty = True  # a buffer replaced by one of another shape: re-pack before next use
            c.binding = None
            if active and viewed(c.device):
                self._name_kept_views(c)
            c.device = None
        group.state = "host"

    def _name_kept_views(self, c: Component) -> None:
        """A module attribute still viewing the device copy its component leaves (``self._wt =
        self.l1.weight.t()`` in a forward) keeps that copy alive and reads it from then on: named
        in a warning, once (later copies are new memory it does not view)."""
        for where in kept_views(c.module, c.device):
            logger.warning(
                "%s: %s keeps a view of the device copy of offloaded weights across calls: it reads the weights of "
                "the call that made it, never later changes to them (also after disable()). Make it again in each "
                "forward, or keep a .clone()", c.name, where,
            )

    def _write_back(self, name: str, pairs) -> None:
        logger.debug("%d tensors of %s changed on the device; copying them home", len(pairs), name)
        write_back(self.backend, pairs)


@functools.cache
def _swaps_run_eagerly() -> None:
    """Swaps run eagerly, also under a compiled root (``compile_disabled``, calls.py). Wrapped when the
    first strategy is built, not at class definition: the wrapper imports torch._dynamo (seconds)
    that ``import offload_core`` should not cost; on the class, not the instance, so that no
    reference cycle keeps a disabled strategy alive until the next garbage collection."""
    for name in ("_release", "_before_use"):
        setattr(ModelLevelOffload, name, compile_disabled(getattr(ModelLevelOffload, name)))
