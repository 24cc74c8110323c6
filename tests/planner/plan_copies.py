"""The bytes a handle's streamed components copied, checked against the plan each call ran under:
shared by the budget tests and the handle-plan tests."""

from __future__ import annotations

def streamed_copies(handle) -> dict[str, tuple[int, int]]:
    """(loads, bytes its blocks copied) of each streamed component so far (its weights loaded back
    after parking left out)."""
    return {p.label: (p.counters.loads, p.counters.h2d_bytes - p.counters.switch_h2d_bytes)
            for p in handle.parts if hasattr(p, "kept_names")}


def copied_as_planned(handle, start: dict[str, tuple[int, int]], plan) -> int:
    """The bytes the streamed components copied since ``start`` (a :func:`streamed_copies`), each
    checked against ``plan``, the one the call ran under (the handle plans again after a first
    call): its forwards times its bytes per forward, plus the first blocks a call's last forward
    queued for a next one (``frozen()``), dropped as the call ends."""
    total = 0
    for label, now in streamed_copies(handle).items():
        part = next(p for p in handle.parts if getattr(p, "label", None) == label)
        loads, copied = now[0] - start[label][0], now[1] - start[label][1]
        forwards, rest = divmod(loads - part.num_slots, len(part.units))
        assert rest == 0 and forwards > 0, (label, loads)
        unused = sum(unit.nbytes for unit in part.units[:part.num_slots])
        assert copied == forwards * plan.component(label).bytes_per_forward + unused, "plan and copies differ"
        total += copied
    return total

