"""``offload-core run``'s report: the figures of one call, as a dict, a table, and a verdict.

Figures named after ``stats()`` keys are the handle's totals since enable (which include enable's
own copies of resident weights); ``call_h2d_*`` are the share of the timed call. The plan a run
is compared with is every weight resident on the device; the verdict says in one line what
offloading bought (device peak as a share of that plan) and what it cost (copy time not hidden).
"""

from __future__ import annotations

from typing import Any

import torch

from ..cli_common import columns
from ..overlap import timeline_overlap
from ..timeline import Timeline
from .outputs import frames_of


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


def make_report(
    args: Any,
    target: Any,
    handle: Any,
    output: torch.Tensor,
    wall: float,
    settings: dict[str, Any],
    timeline: Timeline | None,
    plan_bytes: int,
    before: dict[str, int],
) -> dict[str, Any]:
    frames = frames_of(output)
    steps = settings.get("num_inference_steps")
    stats = handle.stats() if handle is not None else {}
    overlap = timeline_overlap(timeline) if timeline is not None else None
    peak = stats.get("device_peak_bytes")
    report: dict[str, Any] = {
        "pipeline": target.label,
        "pipeline_class": type(target.pipe).__name__,
        "model": str(args.model) if args.model is not None else None,
        "strategy": args.strategy,
        "backend": handle.backend.name if handle is not None else None,
        "prefetch_depth": (args.prefetch_depth or 1) if args.strategy == "layerwise" else None,
        "steps": steps,
        "seed": args.seed,
        "height": int(frames.shape[-2]),
        "width": int(frames.shape[-1]),
        "frames": int(output.shape[1]) if output.dim() == 5 else None,
        "output_shape": list(output.shape),
        "wall_time_s": wall,
        "wall_time_per_step_s": wall / steps if isinstance(steps, int) and steps > 0 else None,
        "device_peak_bytes": peak,
        "device_bytes_without_offload": plan_bytes,
        "device_peak_fraction": peak / plan_bytes if peak is not None and plan_bytes > 0 else None,
        "host_bytes": stats.get("host_bytes"),
        "pinned_host_bytes": stats.get("pinned_host_bytes"),
        "h2d_bytes": stats.get("h2d_bytes"),
        "h2d_copies": stats.get("h2d_copies"),
        "call_h2d_bytes": stats["h2d_bytes"] - before["h2d_bytes"] if stats else None,
        "call_h2d_copies": stats["h2d_copies"] - before["h2d_copies"] if stats else None,
        "prefetch_misses": stats.get("prefetch_misses"),
        "loads": stats.get("loads"),
        "device_timed": timeline.device_timed if timeline is not None else None,
        "copy_time_s": overlap.copy_ns / 1e9 if overlap is not None else None,
        "exposed_copy_time_s": overlap.exposed_ns / 1e9 if overlap is not None else None,
        "overlap": overlap.fraction if overlap is not None else None,
        "trace": None,
        "timeline": None,
        "output_files": [],
    }
    report["verdict"] = verdict(report)
    return report


def verdict(r: dict[str, Any]) -> str:
    """What offloading bought and cost, in one line."""
    if r["strategy"] == "none":
        return "no offload: every weight is on the device for the whole call"
    parts = [f"device peak {r['device_peak_fraction']:.0%} of all weights resident"]
    if r["overlap"] is not None:
        parts.append(f"copies {r['overlap']:.0%} hidden behind compute")
    elif r["device_timed"] is False:
        parts.append(f"copy overlap unknown ({r['backend']} has no device timing)")
    else:
        parts.append("no copies during the call")
    if r["prefetch_misses"]:
        parts.append(f"{r['prefetch_misses']} prefetch misses")
    return ", ".join(parts)


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
    overlap = "n/a"
    if r["overlap"] is not None:
        overlap = (
            f"{r['overlap']:.0%} (copy time {_seconds(r['copy_time_s'])}, "
            f"compute waited {_seconds(r['exposed_copy_time_s'])})"
        )
    moved = "n/a"
    if r["h2d_bytes"] is not None:
        moved = (
            f"{_bytes(r['call_h2d_bytes'])} in {r['call_h2d_copies']} copies during the call "
            f"({_bytes(r['h2d_bytes'])} in {r['h2d_copies']} since enable)"
        )
    peak = _bytes(r["device_peak_bytes"])
    if r["device_peak_fraction"] is not None:
        peak += f" ({r['device_peak_fraction']:.0%} of the plan)"
    rows = [
        ("pipeline", f"{r['pipeline']} ({r['pipeline_class']})"),
        ("strategy", strategy),
        ("backend", r["backend"] or "none (no offload)"),
        ("steps", str(r["steps"]) if r["steps"] is not None else "n/a"),
        ("output size", size),
        ("wall time per step", f"{_seconds(r['wall_time_per_step_s'])} (call: {_seconds(r['wall_time_s'])})"),
        ("device peak, with offload", peak),
        ("device, without offload (plan)", f"{_bytes(r['device_bytes_without_offload'])} (all weights resident)"),
        ("pinned host memory", _bytes(r["pinned_host_bytes"])),
        ("moved host -> device", moved),
        ("prefetch misses", "n/a" if r["prefetch_misses"] is None else str(r["prefetch_misses"])),
        ("overlap (copy hidden)", overlap),
    ]
    for key, label in (("trace", "trace"), ("timeline", "timeline")):
        if r[key]:
            rows.append((label, r[key]))
    if r["output_files"]:
        files = r["output_files"]
        rows.append(("output", files[0] if len(files) == 1 else f"{files[0]} .. {files[-1]} ({len(files)} files)"))
    rows.append(("verdict", r["verdict"]))
    return "\n".join(columns(rows))
