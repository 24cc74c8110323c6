"""The checks of a layerwise part: what it does when the user changed a block's weights.

Between forwards, and even inside one (a pre-hook, another block's hook), the user may give a
block's tensor new data, write it in place or swap a file-backed home. Before a pass, before a
block called alone and as each block binds, the part checks its blocks still show their homes and
takes in what changed (``Part.reconcile``), re-packs, or runs this call on a device copy of data
of another layout (``substitute``). These are rare paths with their own reasoning, kept apart from
the hot path that calls them (passes.py) and from the loads they ask for (loader.py). The checks
hold their part weakly: no reference cycle.
"""

from __future__ import annotations

import logging
import weakref

from ..weights.placeholders import check_placeholders
from .common import device_copy
from .part import adopt_foreign, changed_during_call
from .ring import LoadRecord

logger = logging.getLogger(__name__)


class Checks:
    """The checks one layerwise part makes of its blocks' tensors against their homes."""

    def __init__(self, part, loader) -> None:
        self.part = weakref.proxy(part)
        self.loader = loader
        self.home_policy = part.home_policy

    def reconcile(self, blocks, before_pass: bool = False) -> None:
        """Before a pass (``before_pass``: every block) or a block called alone: each of ``blocks``
        must still show its host views (see ``Part.reconcile`` and the home policy's ``replaced``)."""
        for i in blocks:
            self.check_placeholders(i)
        self.part.reconcile(self._replaced(blocks, before_pass))

    def check_placeholders(self, i: int) -> None:
        if self.loader.records[i].image is not None:
            part = self.part
            check_placeholders(part.units[i].host_views, f"block {part.block_names[i]} of {part.describe()}")

    def retake(self, i: int) -> None:
        """Block ``i`` is about to bind, inside a pass (or run again inside a backward, where a
        re-pack must wait for the next call as well): code run since its load was queued (the
        model's pre-hooks and forward, another block's hooks) or, on one process, since the last
        call (the pass began with the buffers alone, see ``CopyTransport.unchanged``) may have
        given one of its tensors new data. Taken in as at the beginning (``Part.reconcile``) and
        the block loaded again. A parameter given data of another layout cannot be packed around
        now (the pass's blocks are bound): this call runs it on a device copy of that data
        (``substitute``), and the next re-packs. Any other structural change is refused for this
        call (docs/design.md, row 11)."""
        self.check_placeholders(i)
        loader, part = self.loader, self.part
        record = loader.records[i]
        if record.binding.at_home():
            return
        if not list(self.home_policy.replaced([i], loader.records, loader.homes, False, False)):
            return
        loader.quiesce(forget=False)  # copies queued earlier read the host as it was
        relaid = record.binding.relaid() if part.repack_refusal() is None else []
        if relaid:
            part.dirty = True  # first: an interrupt in the substitution still re-packs before the next call
            self.substitute(record, relaid)
        # as Part.reconcile, less its ``dirty`` (set by the substitution above, in this or an earlier block)
        if adopt_foreign(part.backend, record.unit, self._home_now(record)):
            raise changed_during_call(part, f"code run in this call before block {part.block_names[i]}")
        loader.load(i)
        part.wait_ready(i)

    def substitute(self, record: LoadRecord, relaid: list[int]) -> None:
        """Parameters ``relaid`` of ``record``'s block show data of another layout than their home:
        until the next call re-packs the block, it binds a device copy of that data, and goes
        home to the data itself (changes a forward makes copied into it)."""
        part, binding = self.part, record.binding
        ids = {id(binding.params[k]) for k in relaid}
        names = ", ".join(name for name, p in part.blocks[record.index].named_parameters() if id(p) in ids)
        logger.info(
            "%s: %s of block %s were given data of another shape, strides or dtype; this call computes with a device "
            "copy of it, the next packs the block again", part.describe(), names, part.block_names[record.index],
        )
        record.binding = binding.substituted({
            k: device_copy(part.backend, binding.params[k].data, f"new data of {names} ({part.name})") for k in relaid
        })

    def _home_now(self, record: LoadRecord) -> list:
        """What each of the block's tensors shows at home now: its home view, or the data of a
        parameter its binding substitutes (``substitute``)."""
        binding, views = record.binding, self.part.home_views(record.index)
        if binding.base is None:
            return views
        shown = {id(home): now for home, now in zip(binding.base.params_home, binding.params_home)}
        return [shown.get(id(view), view) for view in views]

    def _replaced(self, blocks, before_pass: bool = False):
        """(unit, home views) of each of ``blocks`` the home policy finds replaced (``Part.reconcile``),
        once the copies queued earlier (which read the host as it was) are done."""
        loader, part = self.loader, self.part
        for i in self.home_policy.replaced(blocks, loader.records, loader.homes, part.dirty, before_pass):
            loader.quiesce()
            yield part.units[i], part.home_views(i)
