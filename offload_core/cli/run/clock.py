"""``offload-core run``'s measurements inside the call: when each denoising step ended, and the
device memory over time.

The call's wall time divided by its steps is not a step time: it includes the prompt encoding
and the decoding, which take as long as several steps on a small pipeline. So the steps are
timed from the denoising loop itself: diffusers pipelines call ``callback_on_step_end`` at the
end of every step, and the loop starts at the denoiser's first forward. A pipeline without that
callback (LongCat-Image) is timed from its denoisers' forwards, when they divide evenly into the
steps (each step the same number of forwards). The first step is kept apart, since it pays what
later steps do not (the first loads, lazy initialisation).

Python's garbage collector is the other thing a step can pay that is not offloading's: a full
collection of a process holding a pipeline walks every object it tracks, about 150 ms here, and
lands in whichever step allocates past the threshold, so one step of eight comes out four times
the others on an idle machine. :func:`settled_collector` collects once before the call and moves
every object the loading made out of the collector's reach (``gc.freeze``) for the call's
length; :class:`Collections` records each collection that still runs inside the call, so that
its time is named as a collection and left out of the step times' range.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import threading
import time
from typing import Any, Iterator

from torch import nn

#: pipeline components that run once per denoising step (their first forward starts the loop)
DENOISER_PREFIXES = ("transformer", "unet")
#: how often the device memory is sampled during the call
SAMPLE_INTERVAL_S = 0.0005


class StepClock:
    """Host times (``perf_counter_ns``) of the denoising loop's start and of each step's end."""

    def __init__(self) -> None:
        self.loop_start_ns: int | None = None
        self.step_ends_ns: list[int] = []
        self.forwards_ns: list[tuple[int, int]] = []  # (start, end) of each denoiser forward
        self._forward_start = 0

    def on_step_end(self, pipe: Any, step: int, timestep: Any, callback_kwargs: dict[str, Any]) -> dict[str, Any]:
        self.step_ends_ns.append(time.perf_counter_ns())
        return callback_kwargs

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        self._forward_start = time.perf_counter_ns()
        if self.loop_start_ns is None:
            self.loop_start_ns = self._forward_start

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        self.forwards_ns.append((self._forward_start, time.perf_counter_ns()))

    @contextlib.contextmanager
    def attached(self, pipe: Any) -> Iterator[dict[str, Any]]:
        """Hooks on the pipeline's denoisers while the call runs; yields the call arguments that
        pass the step callback (none where the pipeline takes no ``callback_on_step_end``)."""
        denoisers = [m for name, m in pipe.components.items()
                     if isinstance(m, nn.Module) and name.startswith(DENOISER_PREFIXES)]
        hooks = [m.register_forward_pre_hook(self._on_forward) for m in denoisers]
        hooks += [m.register_forward_hook(self._after_forward) for m in denoisers]
        try:
            yield {"callback_on_step_end": self.on_step_end} if takes_step_callback(pipe) else {}
        finally:
            for hook in hooks:
                hook.remove()

    def finish(self, steps: Any) -> None:
        """Without step callbacks, the step ends from the forwards: each step's last forward."""
        if self.step_ends_ns or not isinstance(steps, int) or steps < 1:
            return
        if self.forwards_ns and len(self.forwards_ns) % steps == 0:
            per_step = len(self.forwards_ns) // steps
            self.step_ends_ns = [self.forwards_ns[(i + 1) * per_step - 1][1] for i in range(steps)]

    def step_seconds(self) -> list[float]:
        """Each step's duration: the first from the loop's start, the others from the step before."""
        return [(end - start) / 1e9 for start, end in self._windows()]

    def collected_seconds(self, pauses: list[tuple[int, int, int]]) -> list[float]:
        """Each step's time inside the garbage collections ``pauses`` (:attr:`Collections.pauses`)."""
        return [sum(max(0, min(at + length, end) - max(at, start)) for at, length, _ in pauses) / 1e9
                for start, end in self._windows()]

    def _windows(self) -> list[tuple[int, int]]:
        if not self.step_ends_ns or self.loop_start_ns is None:
            return []
        return list(zip([self.loop_start_ns, *self.step_ends_ns[:-1]], self.step_ends_ns))


def takes_step_callback(pipe: Any) -> bool:
    """The pipeline's own ``__call__`` takes ``callback_on_step_end`` (looked up along the class
    hierarchy: enabling offload may put a subclass with a generic ``__call__`` in front)."""
    return any("callback_on_step_end" in inspect.signature(cls.__call__).parameters
               for cls in type(pipe).__mro__ if "__call__" in cls.__dict__)


class MemorySampler:
    """The backend's allocated device memory, sampled by a thread every ``SAMPLE_INTERVAL_S``
    while the call runs: (host ``perf_counter_ns``, bytes) pairs."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.samples: list[tuple[int, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="offload-core-run-memory", daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append((time.perf_counter_ns(), self.backend.memory_allocated()))
            if self._stop.wait(SAMPLE_INTERVAL_S):
                self.samples.append((time.perf_counter_ns(), self.backend.memory_allocated()))
                return

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


class Collections:
    """Python's garbage collections while attached (``gc.callbacks``): (host ``perf_counter_ns``
    at its start, its duration in ns, its generation) each."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, int, int]] = []
        self._start: int | None = None

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter_ns()
        elif self._start is not None:
            self.pauses.append((self._start, time.perf_counter_ns() - self._start, int(info["generation"])))
            self._start = None

    def __enter__(self) -> "Collections":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self._callback)


@contextlib.contextmanager
def settled_collector() -> Iterator[None]:
    """One full collection now, then every object alive (the pipeline, its weights' bookkeeping,
    the libraries) frozen out of later collections until the block ends: a collection inside
    the call then walks only what the call itself made."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
