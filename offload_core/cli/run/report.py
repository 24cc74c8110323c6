"""``offload-core run``'s report: the figures of one call, as a dict, a table, and a verdict.

Figures named after ``stats()`` keys are the handle's totals since enable (which include enable's
own copies of resident weights); ``call_h2d_*`` are the share of the timed call. The run is
compared with every weight resident on the device; the verdict says in one line what offloading
bought (the device memory saved) and what it cost (copy time not hidden), and, on a simulator,
that the times are simulated. Copies the strategies made for a block that did not run again
before the call ended (a prefetch for a step that never comes) are counted apart. A step's time
excludes the garbage collections that ran inside it (:class:`.clock.Collections`), which are
listed apart: a collection is the interpreter's pause, not offloading's cost nor a busy machine.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch

from ...common.overlap import timeline_overlap
from ...common.timeline import Timeline
from ..common import columns
from .outputs import frames_of
from .steady import UNRELIABLE, Steady, step_overlaps, unreliable_reasons, waited_share


def weight_bytes(pipe: Any) -> int:
    """Bytes of every distinct parameter and buffer of the pipeline's modules: the plan for running
    without offload (weights only, before the first activation).

    Not ``stats()["host_bytes"]``: packing aligns every tensor, so the host copy is slightly larger
    than the weights, and this figure must be the same whichever strategy the run used."""
    seen: set[int] = set()
    total = 0
    for module in pipe.components.values():
        if not isinstance(module, torch.nn.Module):
            continue
        for t in [*module.parameters(), *module.buffers()]:
            if id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


#: a step's garbage collections the table names (shorter ones are left out of its time all the same)
SHOWN_COLLECTION_S = 0.001


@dataclasses.dataclass
class Measured:
    """What the command measured around and inside the call (times in ms since the timeline's start)."""

    wall_s: float
    step_s: list[float]  # each denoising step's duration, the first from the loop's start
    step_ends_ms: list[float]
    memory_ms: list[tuple[float, int]]  # (time, allocated device bytes) samples
    loop_start_ms: float | None = None  # the denoising loop's start (the denoiser's first forward)
    collected_s: list[float] = dataclasses.field(default_factory=list)  # each step's garbage collections

    @property
    def uncollected_step_s(self) -> list[float]:
        """Each step's duration less the time Python's garbage collector held it."""
        return [s - c for s, c in zip(self.step_s, self.collected_s)] if self.collected_s else list(self.step_s)


def unused_prefetches(timeline: Timeline | None) -> tuple[int, int] | None:
    """(copies, bytes) loading a unit that did not compute after the copy began: prefetches for
    a forward that never came before the call ended."""
    if timeline is None:
        return None
    last_compute: dict[str, int] = {}
    for span in timeline.spans():
        if span.kind == "compute":
            last_compute[span.name] = max(last_compute.get(span.name, -1), span.start_ns)
    unused = [s for s in timeline.spans() if s.kind == "copy" and s.name.startswith("load ")
              and last_compute.get(s.name[len("load "):], -1) < s.start_ns]
    return len(unused), sum(s.nbytes for s in unused)


def make_report(
    args: Any,
    target: Any,
    handle: Any,
    output: torch.Tensor,
    measured: Measured,
    settings: dict[str, Any],
    timeline: Timeline | None,
    bytes_without_offload: int,
    before: dict[str, int],
) -> dict[str, Any]:
    frames = frames_of(output)
    steps = settings.get("num_inference_steps")
    stats = handle.stats() if handle is not None else {}
    overlap = timeline_overlap(timeline) if timeline is not None else None
    peak = stats.get("device_peak_bytes")
    unused = unused_prefetches(timeline)
    later_steps = measured.uncollected_step_s[1:]
    per_step = step_overlaps(timeline, measured.loop_start_ms, measured.step_ends_ms)
    overlap_steps = [o.fraction for o in per_step]
    waited_steps = [waited_share(o) for o in per_step]
    steady_overlap = Steady.of(overlap_steps)
    steady_waited = Steady.of(waited_steps)
    steady_step = Steady.of(measured.uncollected_step_s)
    report: dict[str, Any] = {
        "pipeline": target.label,
        "pipeline_class": type(target.pipe).__name__,
        "model": str(args.model) if args.model is not None else None,
        "strategy": handle.strategy if handle is not None else args.strategy,
        "backend": handle.backend.name if handle is not None else None,
        "prefetch_depth": (args.prefetch_depth or 1) if handle is not None and handle.strategy == "layerwise" else None,
        "plan": _plan_summary(handle.plan) if handle is not None and handle.plan.budget is not None else None,
        "steps": steps,
        "seed": args.seed,
        "height": int(frames.shape[-2]),
        "width": int(frames.shape[-1]),
        "frames": int(output.shape[1]) if output.dim() == 5 else None,
        "output_shape": list(output.shape),
        "simulated": handle is not None and not type(handle.backend).is_accelerator,
        "wall_time_s": measured.wall_s,
        "step_times_s": measured.step_s,
        "collected_s": measured.collected_s,
        "first_step_s": measured.uncollected_step_s[0] if measured.step_s else None,
        "step_s": statistics.median(later_steps) if later_steps else None,
        "device_peak_bytes": peak,
        "device_bytes_without_offload": bytes_without_offload,
        "device_saved_bytes": bytes_without_offload - peak if peak is not None else None,
        "device_saved_fraction": (bytes_without_offload - peak) / bytes_without_offload if peak is not None and bytes_without_offload > 0 else None,
        "host_bytes": stats.get("host_bytes"),
        "pinned_host_bytes": stats.get("pinned_host_bytes"),
        "h2d_bytes": stats.get("h2d_bytes"),
        "h2d_copies": stats.get("h2d_copies"),
        "call_h2d_bytes": stats["h2d_bytes"] - before["h2d_bytes"] if stats else None,
        "call_h2d_copies": stats["h2d_copies"] - before["h2d_copies"] if stats else None,
        "unused_prefetch_copies": unused[0] if unused else None,
        "unused_prefetch_bytes": unused[1] if unused else None,
        "prefetch_misses": stats.get("prefetch_misses"),
        "loads": stats.get("loads"),
        "device_timed": timeline.device_timed if timeline is not None else None,
        "copy_time_s": overlap.copy_ns / 1e9 if overlap is not None else None,
        "exposed_copy_time_s": overlap.exposed_ns / 1e9 if overlap is not None else None,
        "waited_copy_time_s": overlap.waited_ns / 1e9 if overlap is not None else None,
        "overlap": overlap.fraction if overlap is not None else None,
        "overlap_steps": overlap_steps,
        "steady_overlap": steady_overlap.to_dict() if steady_overlap else None,
        "waited_steps": waited_steps,
        "steady_waited": steady_waited.to_dict() if steady_waited else None,
        "steady_step_s": steady_step.to_dict() if steady_step else None,
        "unreliable": None,
        "verdict": None,
        "trace": None,
        "timeline": None,
        "output_files": [],
        "compare": None,
        "ranks": None,
    }
    return report


def judge(report: dict[str, Any], busy: str | None) -> None:
    """Whether the run can vouch for its timed figures (:func:`.steady.unreliable_reasons`:
    ``busy`` is the machine's load when the call began), then the verdict."""
    c = report["compare"]
    compared = (c["step_ratio"], c["step_ratio_spread"]) if c and c["step_ratio"] is not None else None
    report["unreliable"] = unreliable_reasons(busy, _steady(report["steady_waited"]),
                                              _steady(report["steady_step_s"]), compared) or None
    report["verdict"] = verdict(report)


def _steady(figure: dict[str, Any] | None) -> Steady | None:
    return Steady(figure["median"], figure["low"], figure["high"], *figure["steps"]) if figure else None


def verdict(r: dict[str, Any]) -> str:
    """What offloading bought and cost, in one line."""
    if r["strategy"] == "none":
        return "no offload: every weight is on the device for the whole call"
    parts = [memory_words(r)]
    steady = _steady(r["steady_overlap"])
    if steady is not None:
        parts.append(f"copies {steady.median:.0%} hidden behind compute ({steady.low:.0%} to {steady.high:.0%} "
                     f"over {steady.steps})")
    elif r["overlap"] is not None:
        parts.append(f"copies {r['overlap']:.0%} hidden behind compute")
    elif r["device_timed"] is False:
        parts.append(f"copy overlap unknown ({r['backend']} has no device timing)")
    else:
        parts.append("no copies during the call")
    if r["prefetch_misses"]:
        parts.append(f"{r['prefetch_misses']} prefetch misses")
    text = ", ".join(parts) + (f"; {simulated_words(r)}" if r["simulated"] else "")
    return text + (f"; {UNRELIABLE}: {', '.join(r['unreliable'])}" if r["unreliable"] else "")


#: per strategy, what a device peak above every weight resident is made of
ADDED_BY = {
    "layerwise": "the slots and activations outweigh the weights streaming keeps off the device, which are tiny here",
    "distributed": "the slots and activations outweigh the weights streaming keeps off the device, which are tiny "
                   "here",
    "model": "the active component and activations outweigh the components kept off the device, which are tiny here",
    "resident": "the plan keeps every weight on the device, and the call's activations come on top",
}


def memory_words(r: dict[str, Any]) -> str:
    """The device memory offloading saved, or, where the peak's own parts outweigh the weights
    kept off the device, what it added and why, in the terms of the strategy that ran."""
    saved, fraction = r["device_saved_bytes"], r["device_saved_fraction"]
    if saved >= 0:
        return f"device memory {fraction:.0%} lower ({_bytes(saved)} saved)"
    why = ADDED_BY[r["strategy"]]
    return f"device memory {-fraction:.0%} higher ({_bytes(-saved)} more than every weight resident: {why})"


def simulated_words(r: dict[str, Any]) -> str:
    return f"simulated on the CPU ({r['backend']} backend)"


def _plan_summary(plan: Any) -> str:
    """One line of a device plan: the budget, what chose the strategy, the blocks kept."""
    kept = [f"{c.name} {len(c.resident_blocks)} of {c.n_blocks} blocks kept" for c in plan.components
            if c.mode == "streamed"]
    return (f"budget {_bytes(plan.budget)}, {plan.strategy} chosen by the "
            f"{'budget' if plan.chosen_by == 'budget' else 'strategy flag'}" + (f"; {', '.join(kept)}" if kept else ""))


def _bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _seconds(s: float | None) -> str:
    if s is None:
        return "n/a"
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def render(report: dict[str, Any]) -> str:
    """The report as a two-column table for a terminal, the verdict last."""
    r = report
    size = f"{r['width']} x {r['height']}" + (f", {r['frames']} frames" if r["frames"] is not None else "")
    strategy = r["strategy"] + (f" (prefetch depth {r['prefetch_depth']})" if r["prefetch_depth"] else "")
    if r["ranks"] is not None:
        strategy += f" ({r['ranks']} ranks, their outputs equal)"
    simulated = f"; {simulated_words(r)}" if r["simulated"] else ""
    overlap = "n/a"
    if r["overlap"] is not None:
        idle = r["exposed_copy_time_s"] - r["waited_copy_time_s"]
        overlap = (
            f"{r['overlap']:.0%} over the call (copy time {_seconds(r['copy_time_s'])}: compute waited for "
            f"{_seconds(r['waited_copy_time_s'])} of it, and {_seconds(idle)} ran while nothing computed)"
        )
        steady = _steady(r["steady_overlap"])
        if steady is not None:
            overlap += f"; {steady.median:.0%} over {steady.steps} ({steady.low:.0%} to {steady.high:.0%})"
    moved = "n/a"
    if r["h2d_bytes"] is not None:
        used_copies = r["call_h2d_copies"] - (r["unused_prefetch_copies"] or 0)
        used_bytes = r["call_h2d_bytes"] - (r["unused_prefetch_bytes"] or 0)
        moved = f"{_bytes(used_bytes)} in {used_copies} copies used by the call"
        if r["unused_prefetch_copies"]:
            moved += (f", {r['unused_prefetch_copies']} more prefetched for a step that never came "
                      f"({_bytes(r['unused_prefetch_bytes'])})")
        moved += f"; {_bytes(r['h2d_bytes'])} in {r['h2d_copies']} copies since enable"
    steady_step = _steady(r["steady_step_s"])
    if steady_step is not None:
        step = (f"{_seconds(steady_step.median)} (median of {steady_step.steps}, {_seconds(steady_step.low)} to "
                f"{_seconds(steady_step.high)}), first step {_seconds(r['first_step_s'])}")
    elif r["step_s"] is not None:
        step = f"{_seconds(r['step_s'])} (step 2), first step {_seconds(r['first_step_s'])}"
    elif r["first_step_s"] is not None:
        step = f"{_seconds(r['first_step_s'])} (one step)"
    else:
        step = "n/a (no callback_on_step_end, and the denoiser's forwards do not divide into the steps)"
    held = [f"step {i} for {_seconds(c)}" for i, c in enumerate(r["collected_s"], 1) if c >= SHOWN_COLLECTION_S]
    if held:
        step += f"; Python's garbage collector held {', '.join(held)} (left out of these times)"
    rows = [
        ("pipeline", f"{r['pipeline']} ({r['pipeline_class']})"),
        ("strategy", strategy),
        *([("device plan", r["plan"])] if r["plan"] else []),
        ("backend", (r["backend"] or "none (no offload)") + (" (a simulator on the CPU)" if r["simulated"] else "")),
        ("steps", str(r["steps"]) if r["steps"] is not None else "n/a"),
        ("output size", size),
        ("time per step", step + simulated),
        ("call", _seconds(r["wall_time_s"]) + " (prompt encoding, the steps, decoding)" + simulated),
        ("device peak, with offload", _bytes(r["device_peak_bytes"])),
        ("device, without offload", f"{_bytes(r['device_bytes_without_offload'])} (every weight resident)"),
    ]
    if r["device_saved_bytes"] is not None and r["device_saved_bytes"] >= 0:
        rows.append(("device memory saved", f"{_bytes(r['device_saved_bytes'])} ({r['device_saved_fraction']:.0%})"))
    elif r["device_saved_bytes"] is not None:
        rows.append(("device memory added", f"{_bytes(-r['device_saved_bytes'])} ({-r['device_saved_fraction']:.0%})"))
    rows += [
        ("pinned host memory", _bytes(r["pinned_host_bytes"])),
        ("moved host -> device", moved),
        ("prefetch misses", "n/a" if r["prefetch_misses"] is None else str(r["prefetch_misses"])),
        ("overlap (copy hidden)", overlap),
    ]
    if r["compare"] is not None:
        c = r["compare"]
        if c["cost_ratio"] is None:
            rows.append(("without offload", c["note"]))
        else:
            steps = (f" (steps 2-{len(r['step_times_s'])}: {c['step_ratio']:.2f}x +- {c['step_ratio_spread']:.2f})"
                     if c["step_ratio"] is not None else "")
            rows.append(("without offload", f"call {_seconds(c['call_s_without_offload'])}; offloaded / without: "
                         f"{c['cost_ratio']:.2f}x{steps}; same output: {'yes' if c['same_output'] else 'NO'}"
                         + simulated))
    for key, label in (("trace", "trace"), ("timeline", "timeline")):
        if r[key]:
            rows.append((label, r[key]))
    if r["output_files"]:
        files = r["output_files"]
        rows.append(("output", files[0] if len(files) == 1 else f"{files[0]} .. {files[-1]} ({len(files)} files)"))
    rows.append(("verdict", r["verdict"]))
    return "\n".join(columns(rows))
