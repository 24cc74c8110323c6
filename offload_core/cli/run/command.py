"""``offload-core run``: one offloaded pipeline call, and what it cost.

The command answers the question a user has before committing to a strategy: on this pipeline,
how much device memory does offloading save, how many bytes does it move, and how much of that
movement is hidden behind compute? So it runs exactly the one call asked for (no warm-up: the
first call is the one a user pays for), with offloading enabled *before* the clock starts, records
the call's timeline (:meth:`OffloadHandle.trace`), and reports the handle's own counters next to
the figures they are compared with.

:func:`run_pipeline` does the work and returns the output tensor, the timeline and the live
handle, so tests can check the report against ``handle.stats()`` and the image against a run
without offload; :func:`run_command` is the thin command around it (printing, files, exit codes).

Bad input is found before the run starts (:mod:`.arguments` before anything is built or loaded,
then the pipeline's own limits) and is a :class:`~offload_core.cli.common.UsageError` (one line,
exit 2). Anything else that fails is reported as one line with the exception type (exit 1);
``--debug`` adds the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch

from ...common.config import STRATEGIES
from ...device.backend import DeviceBackend
from ...base.errors import OffloadConfigError
from ...common.timeline import Timeline
from ..common import UsageError, Writer, columns, write_all
from . import arguments, loading, outputs, ranks
from .clock import Collections, MemorySampler, StepClock, settled_collector
from .report import Measured, judge, make_report, render, weight_bytes
from .steady import busy_machine, compare_ratio

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RunResult:
    """What one ``run`` produced. ``handle`` is still enabled (None for strategy 'none') so that
    its ``stats()`` can be read; :meth:`close` disables it. ``timeline``: the call's timeline
    (None without offload)."""

    report: dict[str, Any]
    output: torch.Tensor
    handle: Any
    pipe: Any
    timeline: Timeline | None
    measured: Measured
    rank: int = 0  # this process's rank, for --strategy distributed

    def close(self) -> None:
        if self.handle is not None and self.handle.enabled:
            self.handle.disable()


def run_command(args: argparse.Namespace) -> int:
    with _logging(args):
        try:
            return _run_command(args)
        except UsageError:
            raise
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
    if result.rank != 0:  # rank 0 reports and writes the files
        result.close()
        return 0
    try:
        writers: list[Writer] = []
        if args.trace:
            writers.append((Path(args.trace), result.timeline.export_chrome_trace))
        if args.timeline:
            from .drawing import draw_timeline

            writers.append((Path(args.timeline), lambda to: draw_timeline(result.timeline, to, result.report,
                                                                          result.measured)))
        images = outputs.png_writers(result.output, Path(args.output)) if args.output else []
        written = write_all([*writers, *images])
    finally:
        result.close()
    report = result.report
    report["trace"] = args.trace
    report["timeline"] = args.timeline
    report["output_files"] = [str(p) for p in written[len(writers):]]
    print(json.dumps(report, indent=2) if args.json else render(report))
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
    return [{"name": n, "class": s.cls_name, "description": s.description} for n, s in arguments.embedded().items()]


def _render_pipeline_list() -> str:
    return "\n".join(columns([(r["name"], r["class"], r["description"]) for r in pipeline_list()]))


def run_pipeline(args: argparse.Namespace, backend: DeviceBackend | None = None) -> RunResult:
    """Check ``args``, build or load the pipeline, enable offloading, time and trace one call, report.

    ``backend`` (an instance) replaces ``--backend``: tests pass a chaos-mode fake backend.
    """
    arguments.check(args, backend)
    if args.strategy != "none" and backend is None:
        backend = _backend(args.backend)
    if args.strategy != "distributed":
        return _run_pipeline(args, backend)
    with ranks.process_group(backend):
        result = _run_pipeline(args, backend)
        try:
            result.report["ranks"] = ranks.check_outputs_equal(result.output)
        except BaseException:
            result.close()
            raise
        result.rank = ranks.rank()
        result.close()  # disable is collective: every rank does it while the process group lives
        return result


def _run_pipeline(args: argparse.Namespace, backend: DeviceBackend | None) -> RunResult:
    overrides = arguments.overrides(args)
    arguments.check_applies(loading.pipeline_class(args), overrides)
    target = loading.load(args, offloaded=args.strategy != "none")
    arguments.check_applies(type(target.pipe), overrides)
    loading.check_size(target.pipe, overrides)
    target.pipe.set_progress_bar_config(disable=args.json or ranks.rank() != 0)
    bytes_without_offload = weight_bytes(target.pipe)  # before enable rebinds the weights

    handle = _enable(target.pipe, args, backend)
    clock = StepClock()
    try:
        before = handle.stats() if handle is not None else {}
        logger.info("calling %s (%s, seed %d)", target.label, args.strategy, args.seed)
        busy = busy_machine()
        with settled_collector():
            with _traced(handle) as timeline, _sampled(handle) as memory, clock.attached(target.pipe) as callback, \
                    Collections() as collections:
                origin_ns = time.perf_counter_ns()  # the timeline's zero, as near as the host sees it
                start = time.perf_counter()
                output = _call(target, {**overrides, **callback}, args.seed)
                if handle is not None:
                    handle.backend.synchronize()
                wall = time.perf_counter() - start
            _check_output_size(target, overrides, output)
            settings = {**target.defaults, **overrides}
            clock.finish(settings.get("num_inference_steps"))
            measured = Measured(wall, clock.step_seconds(), [(t - origin_ns) / 1e6 for t in clock.step_ends_ns],
                                [((t - origin_ns) / 1e6, b) for t, b in memory.samples] if memory else [],
                                (clock.loop_start_ns - origin_ns) / 1e6 if clock.loop_start_ns is not None else None,
                                clock.collected_seconds(collections.pauses))
            report = make_report(args, target, handle, output, measured, settings, timeline, bytes_without_offload, before)
            if args.compare:
                handle.disable()
                report["compare"] = compare(target, overrides, args.seed, handle.backend, output, wall,
                                            measured.uncollected_step_s)
        judge(report, busy)
    except BaseException:
        if handle is not None and handle.enabled:
            handle.disable()
        raise
    return RunResult(report=report, output=output, handle=handle, pipe=target.pipe, timeline=timeline,
                     measured=measured)


def compare(target: loading.Target, overrides: dict[str, Any], seed: int, backend: DeviceBackend,
            offloaded: torch.Tensor, offloaded_s: float, offloaded_steps: list[float]) -> dict[str, Any]:
    """The same call without offload, every weight on the backend's device (after the offloaded
    one, which ran first and cold): its time, the offloaded call's cost ratio (the whole calls',
    and step by step after the first, with its spread, garbage collections left out of either
    side's steps), whether the outputs are equal."""
    clock = StepClock()
    try:
        target.pipe.to(backend.device())
        with clock.attached(target.pipe) as callback, Collections() as collections:
            start = time.perf_counter()
            resident = _call(target, {**overrides, **callback}, seed)
            backend.synchronize()
            seconds = time.perf_counter() - start
    except torch.OutOfMemoryError:
        return {"call_s_without_offload": None, "cost_ratio": None, "step_ratio": None, "step_ratio_spread": None,
                "same_output": None, "note": "without offload the pipeline does not fit in device memory"}
    clock.finish(len(offloaded_steps))
    resident_steps = [s - c for s, c in zip(clock.step_seconds(), clock.collected_seconds(collections.pauses))]
    steps = compare_ratio(offloaded_steps, resident_steps)
    return {"call_s_without_offload": seconds, "cost_ratio": offloaded_s / seconds,
            "step_ratio": steps[0] if steps else None, "step_ratio_spread": steps[1] if steps else None,
            "same_output": bool(torch.equal(resident.cpu(), offloaded.cpu())), "note": None}


@contextlib.contextmanager
def _sampled(handle: Any) -> Iterator[MemorySampler | None]:
    if handle is None:
        yield None
        return
    with MemorySampler(handle.backend) as sampler:
        yield sampler


@contextlib.contextmanager
def _traced(handle: Any) -> Iterator[Timeline | None]:
    if handle is None:
        yield None
        return
    handle.backend.synchronize()  # enable's own copies are not part of the call
    with handle.trace() as timeline:
        yield timeline


def _call(target: loading.Target, overrides: dict[str, Any], seed: int) -> torch.Tensor:
    try:
        return target.call(overrides, seed)
    except ValueError as exc:
        if not _rejected_input(exc):
            raise
        raise UsageError(f"{type(target.pipe).__name__} rejected the input: {' '.join(str(exc).split())}") from None


def _rejected_input(exc: ValueError) -> bool:
    """True for a diffusers pipeline's input validation (its ``check_inputs`` raised): a size or
    frame count the pipeline cannot take is bad input (exit 2), not a failure of the run."""
    return any(frame.f_code.co_name == "check_inputs" for frame, _ in traceback.walk_tb(exc.__traceback__))


def _check_output_size(target: loading.Target, overrides: dict[str, Any], output: torch.Tensor) -> None:
    """A pipeline that silently made another size than asked for (rounding it) was given bad input."""
    frames = outputs.frames_of(output)
    made = {"height": int(frames.shape[-2]), "width": int(frames.shape[-1])}
    for flag, value in made.items():
        asked = overrides.get(flag)
        if asked is not None and asked != value:
            raise UsageError(
                f"--{flag} {asked}: {type(target.pipe).__name__} made an output {value} pixels in {flag} "
                "(it rounds sizes it cannot take); no file was written"
            )


def _backend(name: str | None) -> DeviceBackend:
    """The backend, made before any model is loaded: an option of it that does not parse (an
    ``OFFLOAD_CORE_FAKE_*`` variable) is bad input, and must not cost a model load."""
    from ...device.plugins import get_backend

    try:
        return get_backend(name)
    except OffloadConfigError as exc:
        raise UsageError(str(exc)) from None


def _enable(pipe: Any, args: argparse.Namespace, backend: DeviceBackend | None):
    if args.strategy == "none":
        return None
    from ...api import enable_offload

    options: dict[str, Any] = {"backend": backend}
    if args.device_memory is not None:
        options["device_memory"] = args.device_memory
    if args.host_memory is not None:
        options["host_memory"] = args.host_memory
    elif args.model is not None:  # read from its checkpoint as from_pretrained reads it
        from ...pretrained.load import host_limit

        options["host_memory"] = host_limit(args.strategy)
    if args.strategy is not None:  # else the device budget picks it
        options[STRATEGIES[args.strategy].flag] = True
    if args.strategy == "layerwise":
        options["prefetch_depth"] = args.prefetch_depth or 1
    if args.storage_dtype is not None:
        options["storage_dtype"] = getattr(torch, args.storage_dtype)
    return enable_offload(pipe, **options)
