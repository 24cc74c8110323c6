"""``offload-core run --timeline``: the timeline's lanes as a picture, for people who would rather
look than read a trace. One row per lane (compute, each copy lane, host), time in milliseconds
along the bottom; compute in blue (labelled with its block where the label fits), copies in
green, compute waiting for a copy in red, host waits and prefetch misses as marks; dashed lines
where the host saw each denoising step end (the device may still be computing it: its work is
queued); below, the device memory allocated over the call, sampled. The title
names the pipeline, the strategy and the backend, and the verdict, which says when the times are
simulated. Needs
matplotlib (the ``plot`` extra); drawn without pyplot, so nothing global (backends, open figures)
is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..timeline import Timeline
from .report import Measured

COLOURS = {"compute": "#4c72b0", "copy": "#55a868", "wait": "#c44e52"}
MARKS = {"host wait": ("v", "#8172b2"), "prefetch miss": ("x", "#c44e52")}
STEP_COLOUR = "#555555"
WIDTH_PX = 1200
#: pixels a label character takes at the font size used for block labels
CHAR_PX = 6.5


def short_label(name: str) -> str:
    """``transformer.single_transformer_blocks.3`` -> ``single_transformer_blocks.3``: the part
    that tells blocks apart."""
    return ".".join(name.split(".")[-2:])


def draw_timeline(timeline: Timeline, path: Path, report: dict[str, Any], measured: Measured) -> None:
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = timeline.lanes() or ["compute"]
    row = {lane: i for i, lane in enumerate(lanes)}
    figure = Figure(figsize=(WIDTH_PX / 100, 2.8 + 0.7 * len(lanes)), layout="constrained")
    axes, memory = figure.subplots(2, 1, sharex=True, height_ratios=[len(lanes) + 1, 1.4])
    spans = timeline.spans()
    end_ms = max([s.end_ns / 1e6 for s in spans] + measured.step_ends_ms + [1e-3])
    px_per_ms = WIDTH_PX * 0.85 / end_ms
    for kind, colour in COLOURS.items():
        for lane in lanes:
            bars = [(s.start_ns / 1e6, max(s.end_ns - s.start_ns, 1) / 1e6)
                    for s in spans if s.lane == lane and s.kind == kind]
            if bars:
                axes.broken_barh(bars, (row[lane] - 0.35, 0.7), facecolors=colour, linewidth=0)
    for s in spans:
        label = short_label(s.name)
        if s.kind == "compute" and (s.end_ns - s.start_ns) / 1e6 * px_per_ms > CHAR_PX * len(label) + 4:
            axes.text((s.start_ns + s.end_ns) / 2e6, row[s.lane], label, ha="center", va="center", fontsize=7,
                      color="white", clip_on=True)
    for kind, (marker, colour) in MARKS.items():
        marks = [i for i in timeline.instants() if i.kind == kind]
        if marks:
            axes.scatter([i.at_ns / 1e6 for i in marks], [row[i.lane] for i in marks], marker=marker, color=colour,
                         zorder=3, label=kind)
    for step, at in enumerate(measured.step_ends_ms, 1):
        for a in (axes, memory):
            a.axvline(at, color=STEP_COLOUR, linestyle="--", linewidth=0.8)
        axes.text(at, -0.5 - 0.55, f"{step} ", fontsize=7, va="center", ha="right", color=STEP_COLOUR)
    handles = [Patch(color=c, label=k if k != "wait" else "compute waits for a copy") for k, c in COLOURS.items()]
    if measured.step_ends_ms:
        handles.append(Line2D([], [], color=STEP_COLOUR, linestyle="--", linewidth=0.8, label="step N ends (host)"))
    axes.legend(handles=[*handles, *axes.get_legend_handles_labels()[0]], loc="upper right", fontsize="small",
                ncols=5)
    axes.set_yticks(range(len(lanes)), lanes)
    axes.set_ylim(len(lanes) - 0.5, -0.5 - 1.0)  # room above the first lane for the legend and step marks
    axes.grid(axis="x", alpha=0.3)
    if measured.memory_ms:
        times, allocated = zip(*measured.memory_ms)
        memory.step([t for t in times], [b / 2**20 for b in allocated], where="post", color="#8172b2")
        memory.fill_between(times, [b / 2**20 for b in allocated], step="post", alpha=0.3, color="#8172b2")
    memory.set_ylabel("device MiB")
    memory.set_ylim(bottom=0)
    memory.set_xlabel("time since the call started (ms)")
    memory.grid(alpha=0.3)
    # the verdict ends with "simulated on the CPU (... backend)" where the times are the simulator's
    axes.set_title(f"{report['pipeline']} ({report['pipeline_class']}), {report['strategy']} offload on the "
                   f"{report['backend']} backend\n{report['verdict']}", fontsize=10)
    figure.savefig(path, format="png", dpi=100)
