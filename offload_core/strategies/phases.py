"""The phase switch of a pipeline's handle: the device goes to the phase that runs.

A pipeline call runs its components in phases (``planning/phases.py``): the prompt is encoded, the
DiT (or each of Wan2.2's experts in turn) denoises, the VAE decodes. Under a device budget the plan
sizes each streamed component's kept blocks for its own phase and says which components *park*:
they hold nothing on the device while a phase they do not run in runs. The switch carries that out
as the call goes: when a component begins a forward, every part the plan does not keep beside it
gives the device up (a streamed part parks, see ``LayerwiseOffload.park``; a staged part swaps its
groups home), and the component's own part loads itself back if it was parked.

It also watches the order in which components begin their forwards during a pipeline call: the
phases a call really has (``planning.phases.observed``), which the handle's plan states after the
first call, and a component that had to be loaded back twice in one call (its phase came back:
the plan's phases were wrong for this pipeline) stops parking, with a warning, rather than
reloading its weights at every forward.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

logger = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Yielding:
    """A part that gives the device up for components it is not planned beside: ``component``
    (its name) stays only when one of ``beside`` (component names) begins."""

    part: Any
    component: str
    beside: frozenset[str]


class PhaseSwitch:
    """Parks the parts the plan does not keep beside the component that begins (see the module
    docstring). ``yielding``: the parts that may give the device up."""

    def __init__(self, yielding: list[Yielding]) -> None:
        self._yielding = yielding
        self._current: str | None = None  # the component that began last
        self._order: list[str] | None = None  # components beginning forwards in the running call
        self._loads: dict[str, int] = {}  # per component, the times it was loaded back in this call
        # (the order components began their forwards in, its steps) of the first pipeline call
        self.observed: tuple[list[str], int] | None = None

    def entering(self, name: str) -> None:
        """Component ``name`` begins a forward."""
        if self._order is not None:
            self._order.append(name)
        if name == self._current:
            return
        self._current = name
        for y in self._yielding:
            if y.component != name and name not in y.beside:
                y.part.give_way(y.component)

    def loaded_back(self, name: str) -> None:
        """The part of component ``name`` loaded itself back after parking; a second time in one
        call means its phase returned: it parks no more."""
        if self._order is None:
            return
        self._loads[name] = self._loads.get(name, 0) + 1
        if self._loads[name] == 2:
            logger.warning(
                "%s was parked and loaded back twice in one pipeline call: it runs in more than one phase of this "
                "pipeline, which the plan did not expect, so it now stays on the device for the rest of the run (the "
                "device may hold more than the plan's peak; handle.plan shows the phases this call had)", name)
            self._yielding = [y for y in self._yielding if y.component != name]

    def begin_call(self) -> None:
        self._order, self._loads = [], {}

    def end_call(self, steps: int) -> None:
        """A pipeline call of ``steps`` denoising steps ended: the first one's order is kept."""
        if self.observed is None and self._order:
            self.observed = (list(self._order), steps)
        self._order = None

    def parking(self) -> set[str]:
        """The components that still give the device up (not stopped by :meth:`loaded_back`)."""
        return {y.component for y in self._yielding}

    def follow(self, plan: Any) -> None:
        """``plan`` (made again after a call) replaces the one the switch was made for: who stays
        beside whom follows its phases."""
        for y in self._yielding:
            y.beside = beside(plan.phases, y.component)

    def close(self) -> None:
        """The handle is disabled: nothing is held any more."""
        self._yielding = []


def beside(phases: Any, name: str) -> frozenset[str]:
    """The components in whose phases component ``name`` keeps its device memory: those it runs
    with and those of the phases the plan keeps it through (``held``)."""
    return frozenset(c for p in phases if name in p.components or name in p.held for c in p.components)


def phase_switch(parts: list, plan: Any) -> PhaseSwitch:
    """The switch of a pipeline's parts under ``plan`` (a plan with phases): the streamed parts
    that park and the staged components (``Part.yields``) give way to the others."""
    return PhaseSwitch([Yielding(part, name, beside(plan.phases, name)) for part in parts for name in part.yields()])
