"""``offload-core run --timeline``: the timeline's lanes as a picture, for people who would rather
look than read a trace. One row per lane (compute, each copy lane, host), time in milliseconds
along the bottom; compute in blue, copies in green, compute waiting for a copy in red, host waits
and prefetch misses as marks. Needs matplotlib (the ``plot`` extra); drawn without pyplot, so
nothing global (backends, open figures) is touched.
"""

from __future__ import annotations

from pathlib import Path

from ..timeline import Timeline

COLOURS = {"compute": "#4c72b0", "copy": "#55a868", "wait": "#c44e52"}
MARKS = {"host wait": ("v", "#8172b2"), "prefetch miss": ("x", "#c44e52")}


def draw_timeline(timeline: Timeline, path: Path, title: str) -> None:
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    lanes = timeline.lanes() or ["compute"]
    row = {lane: i for i, lane in enumerate(lanes)}
    figure = Figure(figsize=(12, 1.6 + 0.7 * len(lanes)), layout="constrained")
    axes = figure.add_subplot()
    spans = timeline.spans()
    for kind, colour in COLOURS.items():
        for lane in lanes:
            bars = [(s.start_ns / 1e6, max(s.end_ns - s.start_ns, 1) / 1e6)
                    for s in spans if s.lane == lane and s.kind == kind]
            if bars:
                axes.broken_barh(bars, (row[lane] - 0.35, 0.7), facecolors=colour, linewidth=0)
    for kind, (marker, colour) in MARKS.items():
        marks = [i for i in timeline.instants() if i.kind == kind]
        if marks:
            axes.scatter([i.at_ns / 1e6 for i in marks], [row[i.lane] for i in marks], marker=marker, color=colour,
                         zorder=3, label=kind)
    handles = [Patch(color=c, label=k if k != "wait" else "compute waits for a copy") for k, c in COLOURS.items()]
    axes.legend(handles=[*handles, *axes.get_legend_handles_labels()[0]], loc="upper right", fontsize="small",
                ncols=5)
    axes.set_yticks(range(len(lanes)), lanes)
    axes.set_ylim(len(lanes) - 0.5, -0.5 - 0.6)  # room above the first lane for the legend
    axes.set_xlabel("time since the call started (ms)")
    axes.set_title(title)
    axes.grid(axis="x", alpha=0.3)
    figure.savefig(path, format="png", dpi=100)
