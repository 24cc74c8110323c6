"""``offload-core plan``: what offloading would do with a pipeline under a device budget, without running it.

The plan comes from :func:`offload_core.planning.make_plan` (the planner ``enable_offload(...,
device_memory=...)`` uses): the strategy, per component the resident and streamed blocks, device
and host bytes, the copies per forward and their predicted time. Nothing runs on a device; the
embedded tiny pipelines are built on the CPU, the real-size ones on the meta device (no weights at
all), and a ``--model`` folder's models on the meta device from their checkpoints' headers, as
``offload_core.from_pretrained`` builds them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from typing import Any

from ..planning.predict import DEFAULT_DISK_BANDWIDTH
from .common import UsageError, budget_type
from .run.arguments import STORAGE_DTYPES

#: host-to-device bytes per second assumed without --bandwidth: about what pinned copies reach over
#: a PCIe 4.0 x16 link (its 32 GB/s raw rate less protocol overhead); measure yours and pass it
DEFAULT_BANDWIDTH = 25e9
DEFAULT_TINY = "flux2-deep"

HELP_EPILOG = f"""\
--pipeline takes an embedded tiny pipeline of 'offload-core run' (built on the CPU, seconds) or
a real-size one built on the meta device from its published config, without weights or download:
real:flux2-dev, real:wan2.2-t2v-a14b, real:qwen-image. '--pipeline list' lists them all.
--model builds a local diffusers folder's models on the meta device (only their checkpoints'
headers are read). --storage-dtype plans the DiTs stored in a narrower dtype, as
enable_offload(..., storage_dtype=) stores them.

Without --strategy the budget chooses: everything resident if it fits with activation headroom,
else model-level if the largest component group fits, else layerwise with as many blocks resident
as fit. Activation headroom is an estimate (each component's largest block, or all of a component
without blocks) unless --activation-memory gives it. The copy time per forward assumes
--bandwidth (default {DEFAULT_BANDWIDTH / 1e9:.0f} GB/s, a PCIe 4.0 x16 link; 'measure': pinned copies
timed on this machine's backend, the simulator when it has no accelerator); with
--block-compute-ms the plan also predicts each streamed component's forward time against the
all-resident one. Exit status: 0 planned, 2 bad input or a budget nothing fits (the message names
the smallest that works)."""


def _bandwidth(text: str) -> float | str:
    return text if text == "measure" else _positive(text)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {text}")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def _resident(text: str) -> int | str:
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 0, got {text!r}")
    return int(text)


def add_plan(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="show how a pipeline would be fitted into a device memory budget, without running it",
        description="Plan offloading of a pipeline into a device memory budget: the strategy, per component "
        "the resident and streamed blocks, device and host bytes, copies per forward and their predicted time.",
        epilog=HELP_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--pipeline", metavar="NAME",
                        help=f"embedded or real-size pipeline (default: {DEFAULT_TINY}); 'list' lists them")
    source.add_argument("--model", metavar="PATH", help="local diffusers pipeline folder (with model_index.json)")
    parser.add_argument("--device-memory", metavar="SIZE", type=budget_type("the device's memory"),
                        help="device memory budget: a size such as 16GiB, or a fraction such as 0.9 of the "
                        "device --backend names (required, except with '--pipeline list')")
    parser.add_argument("--host-memory", type=budget_type("RAM"), metavar="SIZE",
                        help="host RAM budget for weights (bytes, 64GiB, or a fraction of RAM such as 0.5)")
    parser.add_argument("--pinned-memory", type=budget_type("RAM"), metavar="SIZE",
                        help="pinned host memory budget (bytes, 32GiB, or a fraction of RAM)")
    parser.add_argument("--bandwidth", type=_bandwidth, metavar="GB/S",
                        help=f"host-to-device copy bandwidth in GB/s (default {DEFAULT_BANDWIDTH / 1e9:.0f}), "
                        "or 'measure' (timed on this machine's backend)")
    parser.add_argument("--disk-bandwidth", type=_bandwidth, metavar="GB/S",
                        help=f"read rate of the drive blocks on disk come from, in GB/s (default "
                        f"{DEFAULT_DISK_BANDWIDTH / 1e9:.0f}), or 'measure' (read back a file written to the "
                        "temporary folder, evicted from the page cache first)")
    parser.add_argument("--storage-dtype", choices=STORAGE_DTYPES,
                        help="plan the DiTs stored and copied in this dtype, computed in their own "
                        "(enable_offload's storage_dtype=; see docs/float8.md)")
    parser.add_argument("--block-compute-ms", type=_positive, metavar="MS",
                        help="milliseconds one block's forward takes on the device (enables the predicted ratio)")
    shape = parser.add_argument_group(
        "the call's shape: with any of these, activation headroom is estimated from it and each component's "
        "config (without, from the largest block, as enable_offload estimates it before a first call measures)")
    shape.add_argument("--height", type=_count, metavar="PX", help="image or video height (default: the pipeline's)")
    shape.add_argument("--width", type=_count, metavar="PX", help="image or video width (default: the pipeline's)")
    shape.add_argument("--frames", type=_count, metavar="N", help="video frames (default: the pipeline's; 1 for images)")
    shape.add_argument("--batch", type=_count, metavar="N", help="images or videos per prompt (default 1)")
    shape.add_argument("--steps", type=_count, metavar="N", help="denoising steps (default: the pipeline's)")
    parser.add_argument("--activation-memory", type=budget_type(None), metavar="SIZE",
                        help="activation memory of each component's forward (default: an estimate)")
    parser.add_argument("--strategy", choices=("auto", "model", "layerwise"), default="auto",
                        help="auto (default): chosen by the budget; or the strategy the budget then sizes")
    parser.add_argument("--resident-blocks", type=_resident, default="auto", metavar="N",
                        help="blocks each streamed component keeps on the device: auto (default) or a count")
    parser.add_argument("--prefetch-depth", type=int, default=1, metavar="N", help="prefetch depth (default 1)")
    parser.add_argument("--backend", metavar="NAME",
                        help="check the budget against this backend's device, as enable does: a budget above its "
                        "free memory is clamped to it, with a note (default: the auto-detected accelerator, if any; "
                        "without one the plan is for any card)")
    parser.add_argument("--json", action="store_true", help="print the plan as one JSON document")
    parser.set_defaults(run=run_plan)


def pipeline_names() -> dict[str, str]:
    """Every ``--pipeline`` name and what it is: the embedded tiny pipelines, then the real-size ones."""
    from .run.arguments import embedded
    from ..planning.realsize import PIPELINES

    return {**{name: f"tiny: {spec.description}" for name, spec in embedded().items()},
            **{name: f"real size, meta device: {what}" for name, (what, _) in PIPELINES.items()}}


def _components(args: argparse.Namespace, bandwidth: float):
    """The plan inputs of the pipeline the flags name (copies at ``bandwidth`` bytes per second):
    its components, model-level swap groups, phases (with where they come from and the steps of a
    call) and the call's shape."""
    from ..planning.fitting import pipeline_plan_inputs
    from ..discovery.pipelines import pipeline_modules
    from ..planning.phases import REAL_CLASSES

    if args.model is None and (args.pipeline or DEFAULT_TINY).startswith("real:"):
        from ..planning.realsize import build_modules

        pipe, modules = None, build_modules(args.pipeline)  # None: kinds from the component names
        cls_name, call = REAL_CLASSES[args.pipeline], {}
    else:
        from .run.loading import load, pipeline_class

        load_args = argparse.Namespace(model=args.model, pipeline=args.pipeline or DEFAULT_TINY,
                                       host_memory=args.host_memory)
        pipeline_class(load_args)  # checks a --model folder before loading it
        target = load(load_args)
        pipe, call = target.pipe, target.defaults
        modules = pipeline_modules(pipe)
        cls_name = type(pipe).__name__
    if args.storage_dtype is not None:
        _store_narrow(pipe, modules, args.storage_dtype)
    inputs = pipeline_plan_inputs(pipe, modules, cls_name=cls_name, shape=_shape(args, cls_name, call),
                                  steps=args.steps)
    measured = dict(copy_bandwidth=bandwidth,
                    block_compute_s=args.block_compute_ms / 1e3 if args.block_compute_ms else None)
    if args.activation_memory is not None:
        from ..common.config import size

        measured.update(activation_bytes=size(args.activation_memory), activation_from="given")
    return dataclasses.replace(inputs, components=[c.with_measurements(**measured) for c in inputs.components])


def _store_narrow(pipe: Any, modules: list, dtype_name: str) -> None:
    """``--storage-dtype``: the DiTs cast as ``enable_offload(..., storage_dtype=)`` casts them
    before planning (on the meta device too: only their sizes change), so that the plan counts
    their weights as stored."""
    import torch

    from ..interop.casting import cast_for_storage
    from ..base.errors import OffloadConfigError
    from ..discovery.pipelines import pipeline_inventory

    kinds = pipeline_inventory(pipe, modules).kinds
    try:
        cast_for_storage([(n, m) for n, m in modules if kinds[n] == "dit"], getattr(torch, dtype_name))
    except OffloadConfigError as exc:
        raise UsageError(str(exc)) from None


def _shape(args: argparse.Namespace, cls_name: str, call: dict):
    """The call's shape when the flags give one (what they leave out: the loaded pipeline's own
    call, else its class's usual one); None without any, and the activations are the estimate
    ``enable_offload`` plans with too."""
    from ..planning.components import CallShape
    from ..planning.phases import default_shape

    if not any((args.height, args.width, args.frames, args.batch)):
        return None
    height, width, frames = default_shape(cls_name)
    return CallShape(args.height or call.get("height") or height, args.width or call.get("width") or width,
                     args.frames or call.get("num_frames") or frames, args.batch or 1,
                     call.get("max_sequence_length") or CallShape.text_tokens)


def _disk_bandwidth(args: argparse.Namespace) -> tuple[float, str]:
    """Bytes per second the drive reads, and where the figure comes from."""
    if args.disk_bandwidth == "measure":
        from ..bench.disk import drive_read_bandwidth

        return drive_read_bandwidth(), "measured: a file read back from the temporary folder, past the page cache"
    if args.disk_bandwidth:
        return args.disk_bandwidth * 1e9, "--disk-bandwidth"
    return DEFAULT_DISK_BANDWIDTH, "default: a PCIe 4.0 NVMe drive"


def _copy_bandwidth(args: argparse.Namespace) -> tuple[float, str]:
    """Bytes per second the plan's copy times assume, and where the figure comes from."""
    if args.bandwidth == "measure":
        return measure_bandwidth()
    if args.bandwidth:
        return args.bandwidth * 1e9, "--bandwidth"
    return DEFAULT_BANDWIDTH, "default: a PCIe 4.0 x16 link"


def device_memory(name: str | None) -> tuple[int | None, int | None]:
    """``mem_get_info()`` (free, total) of the device the budget is checked against: the backend
    ``name``, or with None the auto-detected one if it is an accelerator; (None, None) without."""
    from .common import available_backend
    from ..device.plugins import get_backend

    try:
        info = available_backend(name)
    except UsageError:
        if name is not None:
            raise
        return None, None  # nothing detected: the plan is for any card
    if name is None and not info.cls.is_accelerator:
        return None, None
    return get_backend(info.name).mem_get_info()


def measure_bandwidth(backend: Any = None, nbytes: int = 64 * 2**20) -> tuple[float, str]:
    """Host-to-device bytes per second of a pinned copy on ``backend`` (default: the one
    auto-detection picks), as the real-size benchmark measures it, and where it comes from."""
    from ..bench.realsize import pinned_copy_bandwidth
    from ..device.plugins import get_backend

    backend = backend if backend is not None else get_backend(None)
    return pinned_copy_bandwidth(backend, nbytes), f"measured: pinned copies on the {backend.name} backend"


def run_plan(args: argparse.Namespace) -> int:
    if args.pipeline == "list":
        from .common import columns

        print("\n".join(columns([[name, what] for name, what in pipeline_names().items()])))
        return 0
    if args.device_memory is None:
        raise UsageError("--device-memory SIZE is required: the budget to plan for, such as 16GiB")
    if args.pipeline is not None and args.pipeline not in pipeline_names():
        raise UsageError(f"unknown pipeline {args.pipeline!r}; known: {', '.join(pipeline_names())}")
    if args.prefetch_depth < 1:
        raise UsageError(f"--prefetch-depth must be >= 1, got {args.prefetch_depth}")
    from ..base.errors import OffloadConfigError
    from ..planning import Rates, device_bytes, make_plan

    free, total = device_memory(args.backend)
    try:
        budget = device_bytes(args.device_memory, total)
    except OffloadConfigError as exc:
        raise UsageError(str(exc)) from None
    bandwidth, bandwidth_source = _copy_bandwidth(args)
    inputs = _components(args, bandwidth)
    disk, disk_source = _disk_bandwidth(args)
    try:
        plan = make_plan(
            inputs.components, budget, device_total=total, device_free=free, groups=inputs.groups,
            strategy=None if args.strategy == "auto" else args.strategy,
            resident_blocks=args.resident_blocks, prefetch_depth=args.prefetch_depth,
            host_memory=args.host_memory, pinned_memory=args.pinned_memory,
            bandwidth_source=bandwidth_source, phases=inputs.phases, phases_source=inputs.phases_source,
            steps=inputs.steps, rates=Rates.of(inputs.components, disk, disk_source),
        )
    except OffloadConfigError as exc:
        raise UsageError(str(exc)) from None
    print(json.dumps(plan.to_dict(), indent=2) if args.json else plan.render())
    return 0
