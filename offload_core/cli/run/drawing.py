"""``offload-core run --timeline``: the timeline's lanes as a picture, for people who would rather
look than read a trace. One row per lane (compute, each copy lane, host), time in milliseconds
along the bottom; compute in blue (labelled with its block where the label fits, else each run of
consecutive blocks of one list with its range, "single_transformer_blocks.0-15"), copies in
green, compute waiting for a copy in red, host waits and prefetch misses as marks; dashed lines
where the host saw each denoising step end (the device may still be computing it: its work is
queued); the time before the denoising loop (prompt encoding) and after its last step (decoding)
shaded and named, since no streamed block computes there. Below, the device memory allocated over
the call, sampled, against the memory every weight takes resident (the run without offload,
before its activations). The title names the pipeline, the strategy and the backend, and the
verdict, which says when the times are simulated. Needs matplotlib (the ``plot`` extra); drawn
without pyplot, so nothing global (backends, open figures) is touched.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ...common.timeline import Timeline
from .report import Measured

COLOURS = {"compute": "#4c72b0", "copy": "#55a868", "wait": "#c44e52"}
MARKS = {"host wait": ("v", "#8172b2"), "prefetch miss": ("x", "#c44e52")}
STEP_COLOUR = "#555555"
OUTSIDE_COLOUR = "#e8e8e8"
RESIDENT_COLOUR = "#c44e52"
#: characters of the verdict per title line
TITLE_CHARS = 150
WIDTH_PX = 1200
#: pixels a label character takes at the font size used for block labels
CHAR_PX = 6.5


def short_label(name: str) -> str:
    """``transformer.single_transformer_blocks.3`` -> ``single_transformer_blocks.3``: the part
    that tells blocks apart."""
    return ".".join(name.split(".")[-2:])


def block_runs(spans: list[Any]) -> list[tuple[float, float, str, str]]:
    """(start ms, end ms, long label, short label) of each run of consecutive compute spans of
    blocks of one list: ``transformer.single_transformer_blocks.0`` .. ``.15`` make
    ``single_transformer_blocks.0-15`` and ``0-15``. Spans not named ``LIST.INDEX`` are not runs."""
    runs: list[dict[str, Any]] = []
    for s in sorted((s for s in spans if s.kind == "compute"), key=lambda s: s.start_ns):
        owner, _, index = s.name.rpartition(".")
        if not index.isdigit():
            continue
        if runs and runs[-1]["owner"] == owner and runs[-1]["last"] + 1 == int(index):
            runs[-1].update(end=s.end_ns, last=int(index))
        else:
            runs.append({"owner": owner, "start": s.start_ns, "end": s.end_ns, "first": int(index), "last": int(index)})
    labelled = []
    for r in runs:
        numbers = f"{r['first']}-{r['last']}" if r["first"] != r["last"] else str(r["first"])
        labelled.append((r["start"] / 1e6, r["end"] / 1e6, f"{r['owner'].split('.')[-1]}.{numbers}", numbers))
    return labelled


def draw_timeline(timeline: Timeline, path: Path, report: dict[str, Any], measured: Measured) -> None:
    timeline_figure(timeline, report, measured).savefig(path, format="png", dpi=100)


def timeline_figure(timeline: Timeline, report: dict[str, Any], measured: Measured) -> Any:
    """The picture as a matplotlib ``Figure``."""
    import textwrap

    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    lanes = timeline.lanes() or ["compute"]
    row = {lane: i for i, lane in enumerate(lanes)}
    figure = Figure(figsize=(WIDTH_PX / 100, 2.8 + 0.7 * len(lanes)), layout="constrained")
    axes, memory = figure.subplots(2, 1, sharex=True, height_ratios=[len(lanes) + 1, 1.4])
    spans = timeline.spans()
    end_ms = max([s.end_ns / 1e6 for s in spans] + measured.step_ends_ms + [measured.wall_s * 1e3, 1e-3])
    px_per_ms = WIDTH_PX * 0.85 / end_ms
    for kind, colour in COLOURS.items():
        for lane in lanes:
            bars = [(s.start_ns / 1e6, max(s.end_ns - s.start_ns, 1) / 1e6)
                    for s in spans if s.lane == lane and s.kind == kind]
            if bars:
                axes.broken_barh(bars, (row[lane] - 0.35, 0.7), facecolors=colour, linewidth=0)
    def fits(start_ms: float, end_ms: float, label: str) -> bool:
        return (end_ms - start_ms) * px_per_ms > CHAR_PX * max(map(len, label.splitlines())) + 4

    compute_lane = row.get("compute", 0)
    for s in spans:
        label = short_label(s.name)
        if s.kind == "compute" and fits(s.start_ns / 1e6, s.end_ns / 1e6, label):
            axes.text((s.start_ns + s.end_ns) / 2e6, row[s.lane], label, ha="center", va="center", fontsize=7,
                      color="white", clip_on=True)
    for start, end, long, short in block_runs(spans):  # runs whose blocks are too narrow to name one by one
        if not any(fits(s.start_ns / 1e6, s.end_ns / 1e6, short_label(s.name)) for s in spans
                   if s.kind == "compute" and start * 1e6 <= s.start_ns < end * 1e6):
            label = long if fits(start, end, long) else short if fits(start, end, short) else None
            if label:
                axes.text((start + end) / 2, compute_lane - 0.5, label, ha="center", va="bottom", fontsize=6,
                          color=COLOURS["compute"], clip_on=True)
    loop_start = measured.loop_start_ms
    call_end = measured.wall_s * 1e3
    outside = [(0.0, loop_start, "prompt encoding")] if loop_start is not None and loop_start > 0 else []
    if measured.step_ends_ms and call_end > measured.step_ends_ms[-1]:
        outside.append((measured.step_ends_ms[-1], call_end, "decoding"))
    for start, end, what in outside:
        axes.axvspan(start, end, color=OUTSIDE_COLOUR, alpha=0.5, linewidth=0, zorder=0, label=what)
        label = f"{what}\n(no streamed block)"
        if fits(start, end, label):
            axes.text((start + end) / 2, compute_lane, label, ha="center", va="center", fontsize=7, color=STEP_COLOUR)
        elif fits(start, end, "x"):  # too narrow to write across: written upwards
            axes.text((start + end) / 2, compute_lane, what, ha="center", va="center", fontsize=6, rotation=90,
                      color=STEP_COLOUR)
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
    resident = report.get("device_bytes_without_offload")
    if resident:
        memory.axhline(resident / 2**20, color=RESIDENT_COLOUR, linestyle="--", linewidth=1,
                       label=f"without offload: every weight resident, {resident / 2**20:.2f} MiB")
        memory.legend(loc="lower right", fontsize="small")
    memory.set_ylabel("device MiB")
    memory.set_ylim(bottom=0, top=max([b / 2**20 for _, b in measured.memory_ms] + [(resident or 0) / 2**20]) * 1.15
                    or None)
    axes.set_xlim(0, end_ms * 1.01)
    memory.set_xlabel("time since the call started (ms)")
    memory.grid(alpha=0.3)
    # the verdict ends with "simulated on the CPU (... backend)" where the times are the simulator's
    verdict = "\n".join(textwrap.wrap(report["verdict"], TITLE_CHARS))
    axes.set_title(f"{report['pipeline']} ({report['pipeline_class']}), {report['strategy']} offload on the "
                   f"{report['backend']} backend\n{verdict}", fontsize=10)
    return figure
