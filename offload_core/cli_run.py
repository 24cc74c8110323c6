"""``offload-core run``: one offloaded pipeline call, and a report of what it cost.

The command answers the question a user has before committing to a strategy: on this pipeline,
how much device memory does offloading save, how many bytes does it move, and how much of that
movement is hidden behind compute? So it runs exactly the one call asked for (no warm-up: the
first call is the one a user pays for), with offloading enabled *before* the clock starts, and
reports the handle's own counters (:meth:`OffloadHandle.stats`) next to the figures they are
compared with.

:func:`run_pipeline` does the work and returns the output tensor and the live handle, so tests
can check the report against ``handle.stats()`` and the image against a run without offload;
:func:`run_command` is the thin command around it (printing, files, exit codes).

Bad input is found before anything is built or loaded (a typo must not cost a model load) and is
a :class:`~offload_core.cli_common.UsageError` (one line, exit 2). Anything else that fails is reported
as one line with the exception type (exit 1); ``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from .backend import Capability, DeviceBackend
from .cli_common import UsageError, available_backend, columns
from .overlap import copy_overlap
from .tiny import PIPELINES, as_tensor

logger = logging.getLogger(__name__)

STRATEGIES = ("none", "model", "layerwise")
DEFAULT_PIPELINE = "flux2" if "flux2" in PIPELINES else next(iter(PIPELINES))
DEFAULT_MODEL_PROMPT = "a cat sitting on a bench"
#: command-line flag (argparse dest) -> the pipeline ``__call__`` parameter it sets
CALL_PARAMETERS = {
    "steps": "num_inference_steps",
    "height": "height",
    "width": "width",
    "frames": "num_frames",
    "prompt": "prompt",
}
#: fields of a diffusers pipeline output that hold the pixels, in the order they are looked for
OUTPUT_FIELDS = ("images", "frames", "videos", "video")

HELP_EPILOG = """\
Without --model, runs one of the embedded tiny pipelines (random weights, seconds on a CPU);
'--pipeline list' lists them. With --model, loads a local diffusers folder (no download).
Sizes, steps and prompt default to the tiny pipeline's settings, or to the model's own defaults.

Strategies: 'none' runs the pipeline as loaded, without offload (the reference output and time);
'model' swaps whole components (enable_cpu_offload); 'layerwise' streams the DiT block by block
(enable_layerwise_offload). Offloading is enabled before the clock starts; the report times the
one call and counts the copies made during it (and since enable). 'overlap' is the share of
host-to-device copy time hidden behind compute, read from the backend's timeline (backends with
the 'trace' capability; otherwise n/a).

--output FILE.png writes an image output to FILE.png; a video (or several images) is written as
one PNG per frame: FILE_0000.png, FILE_0001.png, ... next to FILE.png.

Exit status: 0 done, 1 the run failed (one line; --debug for the traceback), 2 bad input."""


# -- arguments --------------------------------------------------------------------------------


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def add_run(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "run",
        help="run a pipeline once with offloading and report memory, transfers and overlap",
        description="Run a diffusion pipeline once with CPU offloading and report wall time per step,\n"
        "device memory with and without offload, bytes moved, prefetch misses and copy/compute overlap.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--pipeline",
        metavar="NAME",
        help=f"embedded tiny pipeline to run (default: {DEFAULT_PIPELINE}); 'list' lists them",
    )
    source.add_argument("--model", metavar="PATH", help="local diffusers pipeline folder (with model_index.json)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="layerwise", help="default: layerwise")
    parser.add_argument(
        "--backend", metavar="NAME", help="offload backend (default: auto-detect; see 'offload-core backends')"
    )
    parser.add_argument("--steps", type=_count(1), metavar="N", help="denoising steps (num_inference_steps)")
    parser.add_argument("--height", type=_count(1), metavar="H", help="output height in pixels")
    parser.add_argument("--width", type=_count(1), metavar="W", help="output width in pixels")
    parser.add_argument("--frames", type=_count(1), metavar="F", help="video frames (num_frames; video pipelines only)")
    parser.add_argument("--prompt", metavar="TEXT", help="text prompt")
    parser.add_argument("--seed", type=_count(0), default=0, metavar="N", help="seed of the CPU generator (default: 0)")
    parser.add_argument(
        "--prefetch-depth",
        type=_count(1),
        metavar="N",
        help="layerwise: blocks copied ahead of the one computing (default: 1)",
    )
    parser.add_argument(
        "--trace", metavar="FILE.json", help="write the backend's timeline of the call as a Chrome trace"
    )
    parser.add_argument("--output", metavar="FILE.png", help="save the output as PNG (video: FILE_0000.png, ...)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object; no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="log offload_core at INFO level on stderr")
    parser.add_argument("--debug", action="store_true", help="log at DEBUG level; print the traceback of a failure")
    parser.set_defaults(run=run_command)


# -- the command ------------------------------------------------------------------------------


def run_command(args: argparse.Namespace) -> int:
    with _logging(args):
        try:
            return _run_command(args)
        except UsageError:
            raise
        except KeyboardInterrupt:
            print("offload-core: interrupted", file=sys.stderr)
            return 130
        except Exception as exc:  # noqa: BLE001 - the error contract: one line, exit 1
            if args.debug or logging.getLogger("offload_core").isEnabledFor(logging.DEBUG):
                traceback.print_exc()
            lines = str(exc).strip().splitlines()
            what = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
            print(f"offload-core: error: {what}", file=sys.stderr)
            return 1


def _run_command(args: argparse.Namespace) -> int:
    if args.pipeline == "list":
        print(json.dumps(pipeline_list(), indent=2) if args.json else _render_pipeline_list())
        return 0
    result = run_pipeline(args)
    try:
        backend = result.handle.backend if result.handle is not None else None
        if args.trace:
            backend.export_chrome_trace(args.trace)
            result.report["trace"] = str(args.trace)
        if args.output:
            result.report["output_files"] = [str(p) for p in save_pngs(result.output, Path(args.output))]
    finally:
        result.close()
    print(json.dumps(result.report, indent=2) if args.json else render(result.report))
    return 0


@contextlib.contextmanager
def _logging(args: argparse.Namespace) -> Iterator[None]:
    """``-v``/``--debug``: offload_core's log on stderr for this command only (tests call it in-process)."""
    level = logging.DEBUG if args.debug else logging.INFO if args.verbose else None
    if level is None:
        yield
        return
    log = logging.getLogger("offload_core")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    old_level = log.level
    log.addHandler(handler)
    log.setLevel(level)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(old_level)


def pipeline_list() -> list[dict[str, str]]:
    return [{"name": n, "class": s.cls_name, "description": s.description} for n, s in PIPELINES.items()]


def _render_pipeline_list() -> str:
    return "\n".join(columns([(r["name"], r["class"], r["description"]) for r in pipeline_list()]))


# -- running ----------------------------------------------------------------------------------


@dataclasses.dataclass
class RunResult:
    """What one ``run`` produced. ``handle`` is still enabled (None for strategy 'none') so that
    its ``stats()`` can be read; :meth:`close` disables it."""

    report: dict[str, Any]
    output: torch.Tensor
    handle: Any
    pipe: Any

    def close(self) -> None:
        if self.handle is not None:
            self.handle.disable()


@dataclasses.dataclass
class _Target:
    """A loaded pipeline and how to make the one seeded call on it."""

    label: str
    pipe: Any
    call: Callable[[dict[str, Any], int], torch.Tensor]  # (overrides, seed) -> output tensor
    defaults: dict[str, Any]  # call arguments the pipeline runs with unless overridden


def run_pipeline(args: argparse.Namespace, backend: DeviceBackend | None = None) -> RunResult:
    """Validate ``args``, build or load the pipeline, enable offloading, time one call, report.

    ``backend`` (an instance) replaces ``--backend``: tests pass a chaos-mode fake backend.
    """
    _check_flags(args)
    if args.strategy != "none" and backend is None:
        _check_backend(args.backend, need_trace=bool(args.trace))
    elif backend is not None and args.trace and not _can_trace(backend):
        raise UsageError(f"--trace needs a backend with the 'trace' capability; {backend.name!r} has none")
    given = {flag: getattr(args, flag) for flag in CALL_PARAMETERS}
    overrides = {CALL_PARAMETERS[flag]: value for flag, value in given.items() if value is not None}
    cls = _pipeline_class(args)
    if cls is not None:
        _check_applies(cls, overrides)
    target = _build_tiny(args) if args.model is None else _load_model(args)
    _check_applies(type(target.pipe), overrides)
    target.pipe.set_progress_bar_config(disable=args.json)
    plan_bytes = weight_bytes(target.pipe)  # before enable rebinds the weights

    handle = _enable(target.pipe, args, backend)
    try:
        timeline = _timeline(handle.backend) if handle is not None else None
        if handle is not None:
            handle.backend.synchronize()  # enable's own copies are not part of the call
        if timeline is not None:
            timeline.clear()
        before = handle.stats() if handle is not None else {}
        logger.info("calling %s (%s, seed %d)", target.label, args.strategy, args.seed)
        start = time.perf_counter()
        try:
            output = target.call(overrides, args.seed)
        except ValueError as exc:
            if not _rejected_input(exc):
                raise
            raise UsageError(f"{type(target.pipe).__name__} rejected the input: {' '.join(str(exc).split())}") from None
        if handle is not None:
            handle.backend.synchronize()
        wall = time.perf_counter() - start
        settings = {**target.defaults, **overrides}
        report = _report(args, target, handle, output, wall, settings, timeline, plan_bytes, before)
    except BaseException:
        if handle is not None:
            handle.disable()
        raise
    return RunResult(report=report, output=output, handle=handle, pipe=target.pipe)


def _rejected_input(exc: ValueError) -> bool:
    """True for a diffusers pipeline's input validation (its ``check_inputs`` raised): a size or
    frame count the pipeline cannot take is bad input (exit 2), not a failure of the run."""
    return any(frame.f_code.co_name == "check_inputs" for frame, _ in traceback.walk_tb(exc.__traceback__))


def _check_flags(args: argparse.Namespace) -> None:
    if args.pipeline is not None and args.pipeline not in PIPELINES and args.pipeline != "list":
        raise UsageError(f"unknown pipeline {args.pipeline!r}; embedded pipelines: {', '.join(PIPELINES)}")
    if args.strategy == "none":
        offload_only = (("--backend", args.backend), ("--trace", args.trace), ("--prefetch-depth", args.prefetch_depth))
        for flag, value in offload_only:
            if value is not None:
                raise UsageError(f"{flag} does not apply to --strategy none (no offload, no backend)")
    elif args.prefetch_depth is not None and args.strategy != "layerwise":
        raise UsageError(f"--prefetch-depth applies to --strategy layerwise only, not {args.strategy!r}")
    if args.output is not None and Path(args.output).suffix.lower() != ".png":
        raise UsageError(f"--output must name a .png file, got {args.output!r}")
    for flag, value in (("--output", args.output), ("--trace", args.trace)):
        if value is not None and not Path(value).resolve().parent.is_dir():
            raise UsageError(f"{flag} {value!r}: the directory {str(Path(value).resolve().parent)!r} does not exist")


def _can_trace(backend: Any) -> bool:
    return Capability.TRACE in backend.capabilities and hasattr(backend, "export_chrome_trace")


def _check_backend(name: str | None, need_trace: bool) -> None:
    """Name errors before any model is built: unknown, unavailable, or no trace for --trace."""
    info = available_backend(name)
    if need_trace and not _can_trace(info.cls):
        raise UsageError(f"--trace needs a backend with the 'trace' capability; {info.name!r} has none")


def _pipeline_class(args: argparse.Namespace) -> type | None:
    """The pipeline class, known before loading (None: only the loaded pipeline will tell)."""
    if args.model is None:
        import diffusers

        return getattr(diffusers, PIPELINES[args.pipeline or DEFAULT_PIPELINE].cls_name, None)
    path = Path(args.model)
    if not path.exists():
        raise UsageError(f"--model {args.model!r}: no such file or directory")
    index = path / "model_index.json"
    if not path.is_dir() or not index.is_file():
        raise UsageError(f"--model {args.model!r} is not a diffusers pipeline folder (no model_index.json)")
    try:
        name = json.loads(index.read_text(encoding="utf-8"))["_class_name"]
    except (ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"--model {args.model!r}: unreadable model_index.json ({type(exc).__name__}: {exc})") from None
    import diffusers

    return getattr(diffusers, name, None)


def _check_applies(cls: type, overrides: dict[str, Any]) -> None:
    params = inspect.signature(cls.__call__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    flags = {param: flag for flag, param in CALL_PARAMETERS.items()}
    for param in overrides:
        if param not in params:
            raise UsageError(f"--{flags[param]} does not apply to {cls.__name__} (its __call__ has no {param!r})")


def _build_tiny(args: argparse.Namespace) -> _Target:
    from .tiny import build_pipeline

    name = args.pipeline or DEFAULT_PIPELINE
    logger.info("building the tiny pipeline %r", name)
    tiny = build_pipeline(name)
    return _Target(name, tiny.pipe, lambda overrides, seed: tiny.run(seed, **overrides), dict(tiny.call_kwargs))


def _load_model(args: argparse.Namespace) -> _Target:
    from diffusers import DiffusionPipeline

    logger.info("loading %s", args.model)
    pipe = DiffusionPipeline.from_pretrained(args.model, local_files_only=True)
    params = inspect.signature(type(pipe).__call__).parameters
    defaults = {
        name: p.default
        for name, p in params.items()
        if name in CALL_PARAMETERS.values() and p.default is not inspect.Parameter.empty
    }
    fixed: dict[str, Any] = {"output_type": "pt"} if "output_type" in params else {}
    if "prompt" in params:
        fixed["prompt"] = DEFAULT_MODEL_PROMPT

    def call(overrides: dict[str, Any], seed: int) -> torch.Tensor:
        generator = torch.Generator("cpu").manual_seed(seed)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)  # for pipelines that also draw from the global RNG
            output = pipe(**{**fixed, **overrides}, generator=generator)
        return as_tensor(_pixels(output))

    return _Target(str(args.model), pipe, call, {**defaults, **fixed})


def _pixels(output: Any) -> Any:
    for name in OUTPUT_FIELDS:
        value = getattr(output, name, None)
        if value is not None:
            return value
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    raise TypeError(f"no image or video in the pipeline output ({type(output).__name__})")


def _enable(pipe: Any, args: argparse.Namespace, backend: DeviceBackend | None):
    if args.strategy == "none":
        return None
    from .api import enable_offload

    options: dict[str, Any] = {"backend": backend if backend is not None else args.backend}
    if args.strategy == "model":
        options["enable_cpu_offload"] = True
    else:
        options["enable_layerwise_offload"] = True
        options["prefetch_depth"] = args.prefetch_depth or 1
    return enable_offload(pipe, **options)


def _timeline(backend: Any) -> Any | None:
    return getattr(backend, "timeline", None) if Capability.TRACE in backend.capabilities else None


# -- the report -------------------------------------------------------------------------------


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


def frames_of(output: torch.Tensor) -> torch.Tensor:
    """The output as (N, C, H, W) frames: videos (B, F, C, H, W) flattened, channels-last moved."""
    x = output
    if x.dim() >= 3 and x.shape[-1] in (1, 3, 4) and x.shape[-3] not in (1, 3, 4):
        x = x.movedim(-1, -3)  # numpy / PIL layout (..., H, W, C)
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() < 3 or x.dim() > 5:
        raise ValueError(f"cannot read frames from an output of shape {tuple(output.shape)}")
    return x.reshape(-1, *x.shape[-3:])


def _report(args, target, handle, output, wall, settings, timeline, plan_bytes: int, before) -> dict[str, Any]:
    """Figures named after ``stats()`` keys are the handle's totals since enable (which include
    enable's own copies of resident weights); ``call_h2d_*`` are the share of the timed call."""
    frames = frames_of(output)
    steps = settings.get("num_inference_steps")
    stats = handle.stats() if handle is not None else {}
    overlap = copy_overlap(timeline.spans()) if timeline is not None else None
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
        "device_peak_bytes": stats.get("device_peak_bytes"),
        "device_bytes_without_offload": plan_bytes,
        "host_bytes": stats.get("host_bytes"),
        "pinned_host_bytes": stats.get("pinned_host_bytes"),
        "h2d_bytes": stats.get("h2d_bytes"),
        "h2d_copies": stats.get("h2d_copies"),
        "call_h2d_bytes": stats["h2d_bytes"] - before["h2d_bytes"] if stats else None,
        "call_h2d_copies": stats["h2d_copies"] - before["h2d_copies"] if stats else None,
        "prefetch_misses": stats.get("prefetch_misses"),
        "loads": stats.get("loads"),
        "copy_time_s": overlap.copy_ns / 1e9 if overlap is not None else None,
        "exposed_copy_time_s": overlap.exposed_ns / 1e9 if overlap is not None else None,
        "overlap": overlap.fraction if overlap is not None else None,
        "trace": None,
        "output_files": [],
    }
    return report


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
    """The report as a two-column table for a terminal."""
    r = report
    size = f"{r['width']} x {r['height']}" + (f", {r['frames']} frames" if r["frames"] is not None else "")
    strategy = r["strategy"] + (f" (prefetch depth {r['prefetch_depth']})" if r["prefetch_depth"] else "")
    overlap = "n/a"
    if r["overlap"] is not None:
        overlap = (
            f"{r['overlap']:.0%} (copy time {_seconds(r['copy_time_s'])}, "
            f"host waited {_seconds(r['exposed_copy_time_s'])})"
        )
    moved = "n/a"
    if r["h2d_bytes"] is not None:
        moved = (
            f"{_bytes(r['call_h2d_bytes'])} in {r['call_h2d_copies']} copies during the call "
            f"({_bytes(r['h2d_bytes'])} in {r['h2d_copies']} since enable)"
        )
    rows = [
        ("pipeline", f"{r['pipeline']} ({r['pipeline_class']})"),
        ("strategy", strategy),
        ("backend", r["backend"] or "none (no offload)"),
        ("steps", str(r["steps"]) if r["steps"] is not None else "n/a"),
        ("output size", size),
        ("wall time per step", f"{_seconds(r['wall_time_per_step_s'])} (call: {_seconds(r['wall_time_s'])})"),
        ("device peak, with offload", _bytes(r["device_peak_bytes"])),
        ("device, without offload (plan)", f"{_bytes(r['device_bytes_without_offload'])} (all weights resident)"),
        ("pinned host memory", _bytes(r["pinned_host_bytes"])),
        ("moved host -> device", moved),
        ("prefetch misses", "n/a" if r["prefetch_misses"] is None else str(r["prefetch_misses"])),
        ("overlap (copy hidden)", overlap),
    ]
    if r["trace"]:
        rows.append(("trace", r["trace"]))
    if r["output_files"]:
        files = r["output_files"]
        rows.append(("output", files[0] if len(files) == 1 else f"{files[0]} .. {files[-1]} ({len(files)} files)"))
    return "\n".join(columns(rows))


# -- files ------------------------------------------------------------------------------------


def save_pngs(output: torch.Tensor, path: Path) -> list[Path]:
    """Write the output as PNG: one image to ``path``; several frames to ``<stem>_0000.png``, ..."""
    from PIL import Image

    frames = frames_of(output)
    if frames.dtype.is_floating_point:  # diffusers' "pt" / "np" outputs are in [0, 1]
        frames = (frames.float().clamp(0, 1) * 255).round()
    pixels = frames.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()  # N, H, W, C
    if pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    if len(pixels) == 1:
        paths = [path]
    else:
        paths = [path.with_name(f"{path.stem}_{i:04d}{path.suffix}") for i in range(len(pixels))]
    for p, image in zip(paths, pixels):
        Image.fromarray(image).save(p, format="PNG")
    return paths
