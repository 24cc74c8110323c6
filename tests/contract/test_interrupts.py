"""Issue 29, item 12 (docs/design.md, contract row 8): a ``KeyboardInterrupt`` at any line of the
library during a forward, a backward, ``enable`` or ``disable`` leaves the model usable: it then
runs exactly (``torch.equal`` to the model without offload), disables, and enables again.

A trace function (``sys.settrace``) first lists the lines executed inside ``offload_core/`` during
the operation, in the order they are first reached; then, for each chosen line in turn, the
operation runs again with a ``KeyboardInterrupt`` raised when that line is reached. The suite
injects at an even sample of every file's lines (per operation, at most ``PER_FILE`` lines of each
file of the strategies' and the handle's path, two of each other file: about a fifth of the lines
reached); ``OFFLOAD_CORE_ALL_INTERRUPTS=1`` injects at every line reached (the full sweep)."""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import pytest
import torch

import offload_core
from offload_core.handle import HANDLE_ATTRIBUTE

from stacks import StackSpec, build_stack

ROOT = str(Path(offload_core.__file__).parent)
STRATEGIES = {"layerwise": {"enable_layerwise_offload": True}, "model": {"enable_cpu_offload": True}}
OPERATIONS = ["enable", "forward", "backward", "disable"]
PER_FILE = int(os.environ.get("OFFLOAD_CORE_INTERRUPTS_PER_FILE", "8"))  # in the strategies and the handle
PER_OTHER_FILE = 2  # in the rest of the library the path runs through (weights, placement, labels)
PATH = ("strategies/", "handle.py", "changes.py", "enable.py")
ALL = os.environ.get("OFFLOAD_CORE_ALL_INTERRUPTS") == "1"
X = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))


class Injected(KeyboardInterrupt):
    """The interrupt the trace raises (a KeyboardInterrupt, as Ctrl-C is)."""


class Tracer:
    """Lists the lines of ``offload_core/`` reached (``stop_at`` None), or raises at the first
    time line ``stop_at`` is reached."""

    def __init__(self, stop_at: tuple[str, int] | None = None) -> None:
        self.stop_at = stop_at
        self.reached: dict[tuple[str, int], None] = {}
        self.fired = False

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(ROOT):
            return None
        return self._line

    def _line(self, frame, event, arg):
        if event == "line" and not self.fired:
            where = (frame.f_code.co_filename, frame.f_lineno)
            if self.stop_at is None:
                self.reached.setdefault(where)
            elif where == self.stop_at:
                self.fired = True
                raise Injected(f"{where[0]}:{where[1]}")
        return self._line


def traced(tracer: Tracer, operation):
    sys.settrace(tracer)
    try:
        return operation()
    finally:
        sys.settrace(None)


def no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def backend():
    return offload_core.get_backend("fake")


def build():
    model = build_stack(StackSpec(layer_dtypes=[[torch.float32, torch.float32]] * 3))
    return model, copy.deepcopy(model)


def forward(model) -> torch.Tensor:
    with torch.no_grad():
        return model(X).clone()


def loss(model) -> torch.Tensor:
    return model(X).square().sum()


def assert_usable(model, reference, strategy) -> None:
    """Runs exactly, trains exactly, disables, enables again, disables: the weights then equal the
    reference's."""
    handle = getattr(model, HANDLE_ATTRIBUTE, None)
    if handle is None:
        handle = offload_core.enable_offload(model, backend=backend(), **STRATEGIES[strategy])
    assert torch.equal(forward(model), forward(reference))
    assert no_saved_tensor_hooks()  # none left pushed on the thread by the interrupted call
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        loss(m).backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name
        a.grad = b.grad = None
    handle.disable()
    assert getattr(model, HANDLE_ATTRIBUTE, None) is None
    assert torch.equal(forward(model), forward(reference))
    handle = offload_core.enable_offload(model, backend=backend(), **STRATEGIES[strategy])
    assert torch.equal(forward(model), forward(reference))
    handle.disable()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def setup(operation: str, strategy: str):
    """(model, reference, the operation on the model, the handle the user holds or None)."""
    model, reference = build()
    options = STRATEGIES[strategy]
    if operation == "enable":
        return model, reference, lambda: offload_core.enable_offload(model, backend=backend(), **options), None
    handle = offload_core.enable_offload(model, backend=backend(), **options)
    forward(model)  # the state after a first call: measured activations, learned orders
    if operation == "forward":
        return model, reference, lambda: forward(model), handle
    if operation == "backward":
        return model, reference, lambda: loss(model).backward(), handle
    return model, reference, handle.disable, handle


def lines(operation: str, strategy: str) -> list[tuple[str, int]]:
    """The lines reached by the operation, in the order first reached, on its second run (the
    first one also runs what happens once per process: lazy imports, caches)."""
    for _ in range(2):
        model, _, run, handle = setup(operation, strategy)
        tracer = Tracer()
        made = traced(tracer, run)
        (made if operation == "enable" else handle).disable()
    return list(tracer.reached)


def sample(reached: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Every line (the full sweep), or evenly spaced lines of every file: up to ``PER_FILE`` of
    each file of the strategies' and the handle's path, ``PER_OTHER_FILE`` of the others."""
    if ALL:
        return reached
    by_file: dict[str, list] = {}
    for where in reached:
        by_file.setdefault(where[0], []).append(where)
    chosen = []
    for name, found in by_file.items():
        count = PER_FILE if any(part in os.path.relpath(name, ROOT) for part in PATH) else PER_OTHER_FILE
        step = max(len(found) / count, 1)
        chosen += [found[int(k * step)] for k in range(min(count, len(found)))]
    return chosen


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_interrupt_at_any_line_leaves_the_model_usable(strategy, operation):
    reached = lines(operation, strategy)
    files = {f for f, _ in reached}
    assert len(files) > 3, files  # the path runs through the strategies, the handle and the weights
    chosen = sample(reached)
    assert {f for f, _ in chosen} == files  # every file of the path is covered
    failures = []
    fired = 0
    for where in chosen:
        model, reference, run, handle = setup(operation, strategy)
        tracer = Tracer(where)
        try:
            made = traced(tracer, run)
            handle = made if operation == "enable" else handle
        except Injected:
            pass
        fired += tracer.fired
        try:
            if operation == "disable":  # the user calls disable() again: it completes
                handle.disable()
            assert_usable(model, reference, strategy)
        except BaseException as exc:  # noqa: BLE001 - collected, reported together
            failures.append(f"{os.path.relpath(where[0], ROOT)}:{where[1]}: {type(exc).__name__}: {exc}"[:300])
            while not no_saved_tensor_hooks():  # what a failure left pushed fails no later line
                torch._C._autograd._pop_saved_tensors_default_hooks()
    assert fired >= len(chosen) * 0.9, (fired, len(chosen))
    print(f"{strategy} {operation}: injected at {len(chosen)} of {len(reached)} lines reached")
    assert not failures, f"{len(failures)} of {len(chosen)} lines ({len(reached)} reached):\n" + "\n".join(failures)
