"""``offload-core run``'s arguments: the parser, and every check that needs no model.

Everything a user can get wrong on the command line is found here, before a pipeline is built or
loaded, so that a typo costs nothing: unknown names, flags that do not apply to the strategy,
values out of range, and output paths that cannot be written (a missing or read-only directory,
a directory where a file is wanted). Each is a :class:`~offload_core.cli.common.UsageError`: one
line, exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import inspect
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from ...common.config import FLAGGED
from ..common import UsageError, available_backend, budget_type, check_writable

if TYPE_CHECKING:
    from ...device.backend import DeviceBackend
    from ...tiny import PipelineSpec

#: "none" runs the pipeline without offload; the others are the strategies a flag selects, coarsest first
STRATEGY_CHOICES = ("none", *(s.name for s in reversed(FLAGGED)))
DEFAULT_PIPELINE = "flux2-deep"
#: the demo's denoising steps unless --steps is given: enough after the first for its figures to
#: be a steady state with a range (the zoo's pipelines keep their two)
DEMO_STEPS = 8
#: command-line flag (argparse dest) -> the pipeline ``__call__`` parameter it sets
CALL_PARAMETERS = {
    "steps": "num_inference_steps",
    "height": "height",
    "width": "width",
    "frames": "num_frames",
    "prompt": "prompt",
}
#: flags that only mean something when offloading is on
OFFLOAD_FLAGS = ("backend", "trace", "timeline", "prefetch_depth", "compare", "device_memory", "storage_dtype")
#: what ``--storage-dtype`` takes: torch's names of the floating dtypes narrower than a DiT's weights can be
STORAGE_DTYPES = ("float8_e4m3fn", "float8_e5m2", "bfloat16", "float16")
#: largest accepted values: past them a request is a typo, and a run would exhaust memory before
#: saying anything (2**31 steps: the scheduler's timestep table alone does)
MAX_STEPS = 1000
MAX_PIXELS = 16384
MAX_FRAMES = 1024
MAX_PREFETCH_DEPTH = 64
MAX_SEED = 2**63 - 1

HELP_EPILOG = f"""\
Without --model, runs one of the embedded tiny pipelines (random weights, seconds on a CPU);
'--pipeline list' lists them. The default, {DEFAULT_PIPELINE}, is FLUX.2 with a DiT whose blocks
hold most of the weights, so streaming them shows. With --model, loads a local diffusers folder
(no download). Sizes, steps and prompt default to the tiny pipeline's settings, or to the
model's own defaults.

Strategies: 'none' runs the pipeline as loaded, without offload (the reference output and time);
'model' swaps whole components (enable_cpu_offload); 'layerwise' streams the DiT block by block
(enable_layerwise_offload); 'distributed' streams it over several ranks, each holding 1/N of
the blocks (enable_distributed_layerwise_offload), one process per rank started by torchrun:
  torchrun --nproc-per-node 2 -m offload_core run --strategy distributed
every rank's output is checked equal, and rank 0 reports and writes the files.

Offloading is enabled before the clock starts; the report times the one call and each
denoising step (from the pipeline's callback_on_step_end, or its denoiser's forwards; the first
step apart), gives the device memory saved, counts the copies made during the call (prefetches
for a step that never came apart), and ends with a one-line verdict. On a simulator backend (fake)
the times are the simulator's, and the report says so. 'overlap' is the share of host-to-device
copy time during which compute did not wait for a copy, read from the timeline the strategies
record (n/a on a backend without device timing). --compare then runs the same call without
offload, every weight on the device, and prints the cost ratio and whether the outputs are equal.

--trace FILE.json writes that timeline as Chrome trace JSON (open it in Perfetto): per-block
compute on the 'compute' lane, copies on the 'copy' lanes, waits for copies, host waits and
prefetch misses. --timeline FILE.png draws the same lanes, the step boundaries and the device
memory (needs matplotlib: pip install "offload-core[plot]").

--output FILE.png writes an image output to FILE.png; a video (or several images) is written as
one PNG per frame: FILE_0000.png, FILE_0001.png, ... next to FILE.png. Files are written only when
the run succeeded, all or none.

Exit status: 0 done, 1 the run failed (one line; --debug for the traceback), 2 bad input."""


@functools.cache
def embedded() -> dict[str, PipelineSpec]:
    """Every pipeline ``--pipeline`` can build, the demos first (imported when needed: the
    parser alone must not import torch)."""
    from ...tiny import DEMOS, PIPELINES

    return {**DEMOS, **PIPELINES}


def _count(minimum: int, maximum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(f"must be between {minimum} and {maximum}, got {value}")
        return value

    parse.__name__ = "integer"
    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--pipeline",
        metavar="NAME",
        help=f"embedded tiny pipeline to run (default: {DEFAULT_PIPELINE}); 'list' lists them",
    )
    source.add_argument("--model", metavar="PATH", help="local diffusers pipeline folder (with model_index.json)")
    parser.add_argument("--strategy", choices=STRATEGY_CHOICES,
                        help="default: layerwise, or with --device-memory the one the planner picks")
    parser.add_argument("--device-memory", metavar="SIZE", type=budget_type("the device's memory"),
                        help="a device budget (bytes, 16GiB, or a fraction of the device such as 0.5): the planner "
                             "picks the strategy (unless --strategy is given) and the blocks kept on the device")
    parser.add_argument("--storage-dtype", choices=STORAGE_DTYPES,
                        help="store and stream the DiTs' weights in this dtype, computing in their own "
                             "(storage_dtype=: diffusers' layerwise casting; see docs/float8.md)")
    parser.add_argument("--host-memory", metavar="SIZE", type=budget_type("RAM"),
                        help="RAM for the weights (bytes, 64GiB, or a fraction of RAM such as 0.5): blocks beyond it "
                             "are read from disk (default with --model: 90%% of the memory available)")
    parser.add_argument(
        "--backend", metavar="NAME", help="offload backend (default: auto-detect; see 'offload-core backends')"
    )
    parser.add_argument("--steps", type=_count(1, MAX_STEPS), metavar="N", help="denoising steps (num_inference_steps)")
    parser.add_argument("--height", type=_count(1, MAX_PIXELS), metavar="H", help="output height in pixels")
    parser.add_argument("--width", type=_count(1, MAX_PIXELS), metavar="W", help="output width in pixels")
    parser.add_argument(
        "--frames", type=_count(1, MAX_FRAMES), metavar="F", help="video frames (num_frames; video pipelines only)"
    )
    parser.add_argument("--prompt", metavar="TEXT", help="text prompt")
    parser.add_argument(
        "--seed", type=_count(0, MAX_SEED), default=0, metavar="N", help="seed of the CPU generator (default: 0)"
    )
    parser.add_argument(
        "--prefetch-depth",
        type=_count(1, MAX_PREFETCH_DEPTH),
        metavar="N",
        help="layerwise: blocks copied ahead of the one computing (default: 1)",
    )
    parser.add_argument("--trace", metavar="FILE.json", help="write the call's timeline as Chrome trace JSON")
    parser.add_argument("--timeline", metavar="FILE.png", help="draw the call's timeline as a PNG (needs matplotlib)")
    parser.add_argument("--output", metavar="FILE.png", help="save the output as PNG (video: FILE_0000.png, ...)")
    parser.add_argument("--compare", action="store_true", default=None,
                        help="then run the same call without offload and print the cost ratio and whether the "
                        "outputs are equal")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object; no progress bars")
    parser.add_argument("-v", "--verbose", action="store_true", help="log offload_core at INFO level on stderr")
    parser.add_argument("--debug", action="store_true", help="log at DEBUG level; print the traceback of a failure")


def overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The pipeline call arguments the flags set (``__call__`` parameter -> value)."""
    given = {flag: getattr(args, flag) for flag in CALL_PARAMETERS}
    return {CALL_PARAMETERS[flag]: value for flag, value in given.items() if value is not None}


def check(args: argparse.Namespace, backend: DeviceBackend | None) -> None:
    """Every check that needs no model. ``backend``: an instance replacing ``--backend``."""
    if args.pipeline is not None and args.pipeline not in embedded():
        raise UsageError(f"unknown pipeline {args.pipeline!r}; embedded pipelines: {', '.join(embedded())}")
    if args.strategy is None and args.device_memory is None:
        args.strategy = "layerwise"
    if args.strategy == "none":
        for flag in OFFLOAD_FLAGS:
            if getattr(args, flag) is not None:
                raise UsageError(f"{_flag(flag)} does not apply to --strategy none (no offload, no backend)")
    elif args.prefetch_depth is not None and args.strategy != "layerwise":
        raise UsageError(f"--prefetch-depth applies to --strategy layerwise only, not {args.strategy!r}")
    if args.strategy == "distributed":
        from .ranks import check_launched

        check_launched()
    files = {flag: getattr(args, flag) for flag in ("output", "trace", "timeline") if getattr(args, flag) is not None}
    for flag in ("output", "timeline"):
        if flag in files and Path(files[flag]).suffix.lower() != ".png":
            raise UsageError(f"--{flag} must name a .png file, got {files[flag]!r}")
    for flag, path in files.items():
        check_writable(f"--{flag}", path)
    paths = [Path(p).resolve() for p in files.values()]
    if len(set(paths)) < len(paths):
        raise UsageError(f"{', '.join('--' + f for f in files)} must name different files")
    if "output" in files:
        _check_no_frame_name(files)
    if args.timeline is not None and importlib.util.find_spec("matplotlib") is None:
        raise UsageError('--timeline needs matplotlib, which is not installed: pip install "offload-core[plot]"')
    if args.strategy != "none" and backend is None:
        available_backend(args.backend)


def frame_path(output: Path, index: int) -> Path:
    """Where frame ``index`` of a video (or of several images) is written for ``--output FILE.png``."""
    return output.with_name(f"{output.stem}_{index:04d}{output.suffix}")


def _check_no_frame_name(files: dict[str, str]) -> None:
    """No other output file may take a name a frame of ``--output`` could get (how many frames
    there are is known only after the run)."""
    output = Path(files["output"]).resolve()
    frame_name = re.compile(re.escape(output.stem) + r"_\d{4}" + re.escape(output.suffix) + "$")
    for flag, value in files.items():
        path = Path(value).resolve()
        if flag != "output" and path.parent == output.parent and frame_name.match(path.name):
            raise UsageError(
                f"--{flag} {value!r} has the name of a frame of --output {files['output']!r} (a video or several "
                f"images are written as {frame_path(Path(files['output']), 0).name}, ...); choose another name"
            )


def check_applies(cls: type, overrides: dict[str, Any]) -> None:
    """Each call flag names a parameter of the pipeline's ``__call__``."""
    params = inspect.signature(cls.__call__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    flags = {param: flag for flag, param in CALL_PARAMETERS.items()}
    for param in overrides:
        if param not in params:
            raise UsageError(f"--{flags[param]} does not apply to {cls.__name__} (its __call__ has no {param!r})")


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")
