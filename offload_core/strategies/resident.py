"""Modules kept on the device for the whole run, with a host copy so ``disable`` restores them.

The device copy is the truth while they are resident (edits land there, as on a model moved to
the device); ``disable`` copies it back to the host before giving the tensors back.
"""

from __future__ import annotations

import functools
from typing import Sequence

from torch import nn

from ..device.backend import DeviceBackend
from ..hostmem.placement import ONCE, HostUnit
from ..base.locks import locked
from ..common.transaction import Transaction
from ..weights import WeightUnit
from ..weights.owners import collect_tensors
from .common import allocate_device, copy_unit, default_placement, pack_units, unpack_units
from .part import Part, adopt_foreign, write_back


class ResidentModules(Part):
    """Copies modules to the device once; their inputs are moved to the device on the way in."""

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], backend: DeviceBackend) -> None:
        super().__init__(backend)
        self.members = list(modules)
        self._activations: dict[str, int] = {}  # component -> device bytes its first call took beyond the weights
        self._measuring: tuple[str, int] | None = None  # (component, memory allocated as its first call began)
        self._split_units()

    def _split_units(self) -> None:
        self.units = [WeightUnit(name, collect_tensors([m])) for name, m in self.members]

    def host_units(self) -> list:
        """The units whose homes the placement policy decides: each is copied once, at enable."""
        return [HostUnit(u, ONCE, u.nbytes) for u in self.units]

    def describe(self) -> str:
        return ", ".join(name for name, _ in self.members)

    def modules(self) -> list[nn.Module]:
        return [m for _, m in self.members]

    @property
    def device_weight_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    host_bytes = device_weight_bytes

    def enable(self, txn: Transaction) -> None:
        default_placement(self, txn)
        self.device = [allocate_device(self.backend, u.numel, f"{u.name} (resident)") for u in self.units]
        txn.on_rollback(lambda: setattr(self, "device", []))
        pack_units(self.units, self.placement, txn, "resident modules")
        stream = self.backend.new_stream()
        # the new buffers may reuse memory that earlier compute still reads: copy after it
        self.backend.wait_stream(stream, self.backend.current_stream())
        for unit, buf in zip(self.units, self.device):
            self.placement.wait(copy_unit(unit, buf, self.placement, stream, self.counters))
        stream.synchronize()
        self.device_views = [unit.region_views(buf) for unit, buf in zip(self.units, self.device)]
        for unit, views in zip(self.units, self.device_views):
            unit.bind(views)
            txn.on_rollback(lambda unit=unit: unit.bind(unit.host_views))
        # each undo registered before its step: an interrupt inside the step is undone too
        txn.on_rollback(self._remove_hooks)
        self._instrument()
        txn.on_rollback(lambda: setattr(self, "enabled", False))
        self.enabled = True

    def _instrument(self) -> None:
        for name, module in self.members:
            self._wrap(module, functools.partial(self._before, name), functools.partial(self._after, name),
                       self.backend.device())

    def _before(self, name: str) -> None:
        self.reconcile(())  # a module or tensor added (a LoRA layer) is taken onto the device too
        if name not in self._activations and self._measuring is None:  # its first call: what it takes
            self._measuring = (name, self.peak_from_here())

    def _after(self, name: str, failed: bool) -> None:
        if self._measuring is not None and self._measuring[0] == name:
            if not failed:
                self._activations[name] = max(self.backend.max_memory_allocated() - self._measuring[1], 0)
            self._measuring = None

    def measured_activations(self) -> dict[str, int]:
        return dict(self._activations)

    def truth(self) -> list:
        return [(u, views, buf) for u, views, buf in zip(self.units, self.device_views, self.device)]

    def disable(self) -> None:
        locked(self.lock, self._disable)

    def _disable(self) -> None:
        self._remove_hooks()
        if not self.enabled:
            return
        for unit, views, buf in zip(self.units, self.device_views, self.device):
            if unit.host:
                adopt_foreign(self.backend, unit, views)  # the user's same-shape tensors
                write_back(self.backend, [(unit.host[dtype], b) for dtype, b in buf.items()])
        unpack_units(list(zip(self.units, self.device_views)), self.placement)
        self.device, self.device_views = [], []
        self.enabled = False
