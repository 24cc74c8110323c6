"""A tiny discrete-event model of one layerwise forward, and the choice of resident blocks it drives.

The model has two streams and a ring of ``depth + 1`` device slots:

* the **copy stream** copies the streamed blocks, one after another, in execution order; the
  ``j``-th streamed block goes into slot ``j % (depth + 1)``, and its copy starts when the copy
  stream is free *and* the slot's previous occupant (streamed block ``j - depth - 1``) has finished
  computing (a copy never overwrites weights still in use);
* the **compute stream** runs the blocks in order; a streamed block starts when the block before it
  has finished and its own copy has landed; a resident block waits only for the block before it.

Nothing else limits how far the copies run ahead: the ring is the only bound. A forward starts with
empty slots (no copy queued by an earlier forward), so the first streamed block's copy is exposed
unless resident blocks come before it. Everything the model says is a prediction from the copy and
compute times it is given; it never runs a model.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

#: the phases of the evenly spread layouts :func:`choose_resident` compares (see there), besides the
#: one that puts a resident block first
PHASES = (0.0, 0.25, 0.5, 0.75)


@dataclasses.dataclass(frozen=True)
class Forward:
    """The predicted forward: when it ends, and the compute and copy seconds it holds."""

    seconds: float
    compute_seconds: float
    copy_seconds: float

    @property
    def ratio(self) -> float:
        """Forward time over the time with every block resident (1.0: the copies are all hidden)."""
        return self.seconds / self.compute_seconds if self.compute_seconds else 1.0


def _per_block(value: float | Sequence[float], n: int, what: str) -> list[float]:
    values = [float(value)] * n if isinstance(value, (int, float)) else [float(v) for v in value]
    if len(values) != n or any(v < 0 for v in values):
        raise ValueError(f"{what}: expected one value >= 0, or {n} of them, got {value!r}")
    return values


def simulate(resident: Sequence[bool], copy_s: float | Sequence[float], compute_s: float | Sequence[float],
             depth: int = 1) -> Forward:
    """The forward of ``len(resident)`` blocks in order, ``resident[i]`` saying whether block ``i``
    stays on the device; ``copy_s`` / ``compute_s``: seconds per block (one value for all, or one
    per block; a resident block's copy time is not used); ``depth``: the prefetch depth (slots - 1)."""
    n = len(resident)
    copies, computes = _per_block(copy_s, n, "copy_s"), _per_block(compute_s, n, "compute_s")
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    slots = depth + 1
    # Copies run in execution order and wait only on earlier blocks' compute, so one pass in
    # execution order schedules both streams.
    compute_end = [0.0] * n
    streamed: list[int] = []
    copy_free = now = 0.0
    for i in range(n):
        if resident[i]:
            start = now
        else:
            previous = compute_end[streamed[-slots]] if len(streamed) >= slots else 0.0
            copy_free = max(copy_free, previous) + copies[i]
            streamed.append(i)
            start = max(now, copy_free)
        now = compute_end[i] = start + computes[i]
    return Forward(now, sum(computes), sum(copies[i] for i in streamed))


def spread(n_blocks: int, count: int, phase: float = 0.0) -> tuple[int, ...]:
    """``count`` resident blocks of ``n_blocks`` with the streamed ones evenly spread between them:
    the ``j``-th streamed block sits at ``floor((j + phase) * n_blocks / streamed)``."""
    streamed = n_blocks - count
    if streamed <= 0:
        return tuple(range(n_blocks))
    if not 0.0 <= phase < 1.0:
        raise ValueError(f"phase must be in [0, 1), got {phase}")
    # distinct and below n_blocks, since n_blocks / streamed >= 1 and phase < 1
    positions = {int((j + phase) * n_blocks / streamed) for j in range(streamed)}
    return tuple(i for i in range(n_blocks) if i not in positions)


def choose_resident(n_blocks: int, count: int, copy_s: float | Sequence[float] | None = None,
                    compute_s: float | Sequence[float] | None = None, depth: int = 1) -> tuple[int, ...]:
    """Which ``count`` of ``n_blocks`` blocks stay on the device (their indices, ascending).

    The rule: a streamed block's copy can only hide behind compute that runs while it is copied,
    which is the compute of the blocks before it; and the ring lets copies run at most ``depth + 1``
    streamed blocks ahead. Bunching the resident blocks together (all first, or all last) gives the
    copies a long stretch of compute to hide behind that the ring cannot use (only ``depth + 1``
    copies fit ahead), then a stretch of streamed blocks with nothing to hide behind. So the
    streamed blocks are spread evenly between the resident ones, each getting about the same share
    of resident compute before it. Where the pattern starts (its phase) matters at the edges (a
    streamed block first exposes its copy at the start of the forward), so the layouts of
    :data:`PHASES` are compared in :func:`simulate` and the fastest is taken (the earliest phase on
    a tie). Without timings (``copy_s`` or ``compute_s`` None), the phase whose first block is
    resident (so the first copy hides behind it) is taken.
    """
    if not 0 <= count <= n_blocks:
        raise ValueError(f"count must be in 0..{n_blocks}, got {count}")
    # the last phase makes block 0 resident when any block is: (1 - 1/(n+1)) * n / streamed > 1
    phases = (*PHASES, 1.0 - 1.0 / (n_blocks + 1))
    layouts = list(dict.fromkeys(spread(n_blocks, count, phase) for phase in phases))
    if count in (0, n_blocks) or len(layouts) == 1:
        return layouts[0]
    if copy_s is None or compute_s is None:
        return next((layout for layout in layouts if layout[0] == 0), layouts[0])

    def seconds(layout: tuple[int, ...]) -> float:
        chosen = set(layout)
        return simulate([i in chosen for i in range(n_blocks)], copy_s, compute_s, depth).seconds

    return min(layouts, key=seconds)
