"""Modules kept on the device for the whole run, with a host copy so ``disable`` restores them."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from ..backend import DeviceBackend
from ..hostmem.placement import ONCE, HostUnit
from ..weights import WeightUnit
from ..weights.unit import collect_tensors
from .common import (
    Counters, Transaction, allocate_device, copy_unit, default_placement, inputs_to_device, pack_units, unpack_units,
)


class ResidentModules:
    """Copies modules to the device once; their inputs are moved to the device on the way in."""

    #: set while ``handle.trace()`` records; nothing moves after enable, so nothing is recorded
    timeline = None

    def __init__(self, modules: Sequence[tuple[str, nn.Module]], backend: DeviceBackend) -> None:
        self.backend = backend
        self.counters = Counters()
        self.modules = list(modules)
        self.units = [WeightUnit(name, collect_tensors([m])) for name, m in self.modules]
        self._hooks: list = []
        self.placement = None  # set by the enabling code (plan_placement) before enable

    def host_units(self) -> list:
        """The units whose homes the placement policy decides: each is copied once, at enable."""
        return [HostUnit(u, ONCE, u.nbytes) for u in self.units]

    @property
    def device_weight_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)

    host_bytes = device_weight_bytes

    def enable(self, txn: Transaction) -> None:
        default_placement(self, txn)
        buffers = [allocate_device(self.backend, u.numel, f"{u.name} (resident)") for u in self.units]
        pack_units(self.units, self.placement, txn, "resident modules")
        stream = self.backend.new_stream()
        # the new buffers may reuse memory that earlier compute still reads: copy after it
        self.backend.wait_stream(stream, self.backend.current_stream())
        for unit, buf in zip(self.units, buffers):
            self.placement.wait(copy_unit(unit, buf, self.placement, stream, self.counters))
        stream.synchronize()
        for unit, buf in zip(self.units, buffers):
            unit.bind(buf)
            txn.on_rollback(lambda unit=unit: unit.bind(unit.host))
        hook = inputs_to_device(self.backend.device())
        self._hooks = [m.register_forward_pre_hook(hook, with_kwargs=True) for _, m in self.modules]
        txn.on_rollback(self._remove_hooks)

    def _remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def disable(self) -> None:
        self._remove_hooks()
        unpack_units(self.units, self.placement)
