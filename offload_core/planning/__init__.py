"""Fitting a pipeline into a device budget ("tell it your memory"): the plan of what stays on the
device, what streams, and what that costs, made from byte counts and timings alone.

- :class:`Component`: what the planner knows of one component (bytes, blocks, activations, timings);
  :mod:`.modules` makes them from torch modules (a pipeline's components included), :mod:`.realsize` from real-size
  configs on the meta device.
- :func:`make_plan`: the :class:`Plan` of a budget; :func:`describe`: the plan of what a strategy
  flag alone set up; :func:`choose_resident` / :func:`simulate`: which blocks stay
  resident, from a discrete-event model of the copy and compute streams.
- :class:`Phase` (:mod:`.phases`): when each component of a pipeline call runs, which the plan
  gives the device to in turn; :mod:`.predict`: what each phase copies, reads and takes.

Importing this package imports no torch (the CLI's ``plan --help`` stays fast); :mod:`.modules` and
:mod:`.realsize` do.
"""

from .components import CallShape, Component, device_bytes
from .phases import Phase, observed, pipeline_phases
from .plan import ComponentPlan, PhasePlan, Plan
from .planner import describe, make_plan
from .predict import Rates
from .timing import Forward, choose_resident, simulate

__all__ = ["CallShape", "Component", "ComponentPlan", "Forward", "Phase", "PhasePlan", "Plan", "Rates",
           "choose_resident", "describe", "device_bytes", "make_plan", "observed", "pipeline_phases", "simulate"]
