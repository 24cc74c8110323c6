"""Model-level offloading: whole component groups swap between host and device.

Each component's weights live in flat host buffers (the same packing as layerwise). At most one
group is *active* on the device; a group becomes active when any of its modules runs. Swapping a
group out only re-binds its tensors to their host buffers and drops the device buffers: weights
are frozen, so no device-to-host copy is needed. Swapping in is one copy per dtype per component.

Unlike a synchronous swap, the next group (learned from the order groups ran in before, else the
pipeline's declared order) is copied early, on a side stream, whenever the device reports room for
it beside the active group, so the swap overlaps compute.

In-place changes to weights on the device are detected at swap-out through tensor version
counters; they are copied back to the host (and logged) rather than silently lost.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Sequence

import torch
from torch import nn

from ..backend import DeviceBackend, Event
from ..hostmem.placement import SWAP, HostUnit
from ..timeline import UNTRACED
from ..weights import WeightUnit
from ..weights.unit import collect_tensors
from .calls import CallWrapper
from .common import Counters, Transaction, allocate_device, default_placement, pack_units, unpack_units

logger = logging.getLogger(__name__)

#: share of the device's total memory kept free of prefetched weights, for activations
RESERVE_FRACTION = 0.1


@dataclasses.dataclass
class Component:
    name: str
    module: nn.Module
    unit: WeightUnit
    device: dict[torch.dtype, torch.Tensor] | None = None
    versions: list[int] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Group:
    name: str
    components: list[Component]
    ready: Event | None = None
    state: str = "host"  # "host" | "loading" | "active"
    ticket: object = None  # the stager's ticket of a pending load (homes outside pinned memory)

    @property
    def nbytes(self) -> int:
        return sum(c.unit.nbytes for c in self.components)


class ModelLevelOffload:
    """Swaps named groups of modules; the order hint is the groups' usual order of use."""

    #: set while ``handle.trace()`` records; spans are named after the groups
    timeline = None

    def __init__(
        self,
        groups: Sequence[tuple[str, Sequence[tuple[str, nn.Module]]]],
        backend: DeviceBackend,
        prefetch: bool = True,
        release_after: nn.Module | None = None,
    ) -> None:
        self.backend = backend
        self.prefetch = prefetch
        self.counters = Counters()
        self.groups: list[Group] = []
        seen: set[int] = set()
        for group_name, members in groups:
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
        # the group that usually runs next: the declared order first, then what was observed within
        # a call; the last group has none, so nothing is prefetched only to be released at call end
        self._next: dict[int, int | None] = {i: i + 1 for i in range(len(self.groups) - 1)}
        self._active: int | None = None
        self._hooks: list = []
        self._release_after = release_after  # a bare module: swap out when its forward returns
        self.peak_weight_bytes = 0
        self.placement = None  # set by the enabling code (plan_placement) before enable

    def host_units(self) -> list:
        """The units whose homes the placement policy decides: each swaps in once per call."""
        return [HostUnit(c.unit, SWAP, c.unit.nbytes) for g in self.groups for c in g.components]

    @classmethod
    def for_module(cls, module: nn.Module, backend: DeviceBackend) -> "ModelLevelOffload":
        """A bare module is one group: it lives on the host between calls, is copied in (one copy
        per dtype) when it runs, and is dropped when its forward returns, as a pipeline's
        components are at the end of a pipeline call."""
        name = type(module).__name__
        return cls([(name, [(name, module)])], backend, prefetch=False, release_after=module)

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
        default_placement(self, txn)
        units = [c.unit for g in self.groups for c in g.components]
        pack_units(units, self.placement, txn, "components")
        self.copy_stream = self.backend.new_stream()
        device = self.backend.device()
        for index, group in enumerate(self.groups):
            group.ready = self.backend.new_event()
            for c in group.components:
                after = self.release_all if c.module is self._release_after else None
                self._hooks.append(CallWrapper(c.module, functools.partial(self._before_use, index), after, device))
                for child in c.module.children():  # encode()/decode() bypass the root's call
                    self._hooks.append(child.register_forward_pre_hook(functools.partial(self._child_hook, index)))
        txn.on_rollback(self._remove_hooks)
        logger.info(
            "model-level offload: %s",
            ", ".join(f"{g.name} ({g.nbytes / 2**20:.1f} MB)" for g in self.groups),
        )

    def disable(self) -> None:
        self._remove_hooks()
        self.placement.drain()
        self.copy_stream.synchronize()
        for group in self.groups:
            self._swap_out(group)
        unpack_units([c.unit for g in self.groups for c in g.components], self.placement)

    def release_all(self) -> None:
        """Swap every group out (end of a pipeline call), keeping the learned order."""
        if self.timeline is not None:
            self.timeline.end_compute(self.backend.current_stream())
        for group in self.groups:
            self._swap_out(group)
        self._active = None

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # -- swapping -------------------------------------------------------------------------
    def _child_hook(self, index: int, module: nn.Module, args) -> None:
        """A child called directly (``vae.decode``) activates its group. Traced inside a compiled
        root, where the group is active already, it is a guarded no-op, so the graph is whole."""
        if self._active != index:
            self._before_use(index)

    @torch.compiler.disable
    def _before_use(self, index: int) -> None:
        if self._active == index:
            return
        if self.timeline is not None:  # the active group's compute has all been issued
            self.timeline.end_compute(self.backend.current_stream())
        previous = self._active
        for i, group in enumerate(self.groups):
            if i != index and group.state != "host":
                self._swap_out(group)
        group = self.groups[index]
        if group.state == "host":
            self._load(group)
        compute = self.backend.current_stream()
        self._issued(group)
        with UNTRACED if self.timeline is None else self.timeline.compute_after(compute, group.name):
            group.ready.wait(compute)
        for c in group.components:
            c.unit.bind(c.device)
            c.versions = [p._version for p in c.module.parameters()]
        group.state = "active"
        self._active = index
        if previous is not None:
            self._next[previous] = index
        following = self._next.get(index)
        if self.prefetch and following is not None:
            self._maybe_prefetch(following)

    def _load(self, group: Group) -> None:
        """Allocate the group's device buffers and queue its copies (one per dtype per component),
        after all compute issued so far: the device buffers freed before may be reused."""
        group.state = "loading"
        freed = self._freed()
        transfers = []
        for c in group.components:
            c.device = allocate_device(self.backend, c.unit.numel, f"{c.name} on the device ({group.name} group)")
            transfers += self.placement.transfers(c.unit, c.device)
            self.counters.h2d_bytes += c.unit.nbytes
        self.counters.h2d_copies += self.placement.copies(transfers)
        group.ticket = self.placement.run(functools.partial(self._queue_load, group, freed, transfers))
        self.counters.loads += 1
        self.peak_weight_bytes = max(self.peak_weight_bytes, self._device_bytes())

    def _queue_load(self, group: Group, freed: Event, transfers: list) -> None:
        """Queue a group's copies after ``freed`` and its ready event after them (at once, or on
        the stager thread when some component is staged)."""
        stream = self.copy_stream
        freed.wait(stream)
        issue = functools.partial(self.placement.issue, transfers, stream)
        if self.timeline is None:
            issue()
        else:
            self.timeline.copy(stream, group.name, group.nbytes, issue)
        group.ready.record(stream)

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
        free, total = self.backend.mem_get_info()
        if group.nbytes <= free - RESERVE_FRACTION * total:
            logger.debug("prefetching %s while %s computes", group.name, self.groups[self._active].name)
            self._load(group)

    def _swap_out(self, group: Group) -> None:
        if group.state == "host":
            return
        if group.state == "loading":  # its copies still read the host buffers; cheap, rare
            self._issued(group)
            with UNTRACED if self.timeline is None else self.timeline.host_wait(f"unload {group.name} (still loading)"):
                group.ready.synchronize()
        for c in group.components:
            if group.state == "active":
                self._keep_inplace_changes(c)
            c.unit.bind(c.unit.host)
            c.device = None
        group.state = "host"

    def _keep_inplace_changes(self, c: Component) -> None:
        params = list(c.module.parameters())
        changed = [i for i, (p, v) in enumerate(zip(params, c.versions)) if p._version != v]
        if not changed:
            return
        logger.warning(
            "%d weights of %s were modified in place while on the device; copying them back to the host "
            "(offloaded weights are meant to be frozen)", len(changed), c.name,
        )
        self.placement.drain()  # the stager issues on the copy stream too
        self.backend.wait_stream(self.copy_stream, self.backend.current_stream())
        for dtype, buf in c.device.items():
            self.backend.copy_async(c.unit.host[dtype], buf, self.copy_stream)
        self.copy_stream.synchronize()
