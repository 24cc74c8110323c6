"""Issue 29, item 12 and issue 42, item 2 (docs/design.md, contract row 8): a ``KeyboardInterrupt``
at any line of the library during a forward, a backward, ``enable`` or ``disable`` leaves the
model usable: it then runs exactly (``torch.equal`` to the model without offload), disables, and
enables again, from another thread too (no lock is left held), and every byte the backend counts
is given back.

A trace function (``sys.settrace``) first lists the points executed inside ``offload_core/``
during the operation, in the order they are first reached; then, for each chosen point in turn,
the operation runs again with a ``KeyboardInterrupt`` raised when that point is reached. A point
is a line event: a line, and the instruction it starts at, so that a line reached again at
another instruction is a point of its own (a ``with`` statement's line is reached again when its
block ends, just before the lock it took is released: the issue's hang). Finalizers the
operation runs (a garbage collection inside it) are traced too. The suite injects at an even
sample of every file's points (per operation, at most ``PER_FILE`` points of each file of the
strategies', the handle's and the bookkeeping's path, two of each other file: about a fifth of
the points reached); ``OFFLOAD_CORE_ALL_INTERRUPTS=1`` injects at every point reached (the full
sweep). What follows an injection runs on another thread under a deadline
(``OFFLOAD_CORE_INTERRUPT_DEADLINE`` seconds), so that a lock left held fails the test, naming
the point and where the thread waits, instead of hanging it."""

from __future__ import annotations

import copy
import gc
import os
import sys
import threading
import traceback

import pytest
import torch

import offload_core
from offload_core.handle import HANDLE_ATTRIBUTE

from contract_models import ENABLE_OPTIONS
from interrupting import LIBRARY as ROOT, Injected, Point, Tracer
from stacks import StackSpec, build_stack

OPERATIONS = ["enable", "forward", "backward", "disable"]
PER_FILE = int(os.environ.get("OFFLOAD_CORE_INTERRUPTS_PER_FILE", "8"))  # in the files of PATH
PER_OTHER_FILE = 2  # in the rest of the library the path runs through (weights, placement)
#: the strategies, the handle, and the bookkeeping that locks and finalizers guard
PATH = ("strategies/", "handle.py", "common/changes.py", "enabling/enable.py", "common/labels.py", "slabs.py",
        "memory_accounting.py")
ALL = os.environ.get("OFFLOAD_CORE_ALL_INTERRUPTS") == "1"
DEADLINE = float(os.environ.get("OFFLOAD_CORE_INTERRUPT_DEADLINE", "60"))
X = torch.randn(3, 8, generator=torch.Generator().manual_seed(5))


def traced(tracer: Tracer, operation):
    sys.settrace(tracer)
    try:
        return operation()
    finally:
        sys.settrace(None)


def no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def thread_state() -> list[str]:
    """The autograd state a call of the library changes on its thread and must put back."""
    left = [] if no_saved_tensor_hooks() else ["saved-tensor hooks pushed"]
    if not torch.is_grad_enabled():
        left.append("grad mode off")
    if torch.is_inference_mode_enabled():
        left.append("inference mode on")
    return left


def backend():
    return offload_core.get_backend("fake")


def counts() -> tuple[int, int]:
    """(device, pinned) bytes the backend counts as allocated, after a collection."""
    gc.collect()
    return backend().memory_allocated(), backend().pinned_memory_allocated()


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
        handle = offload_core.enable_offload(model, backend=backend(), **ENABLE_OPTIONS[strategy])
    assert torch.equal(forward(model), forward(reference))
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
        loss(m).backward()
    for (name, a), b in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(a.grad, b.grad), name
        a.grad = b.grad = None
    handle.disable()
    assert getattr(model, HANDLE_ATTRIBUTE, None) is None
    assert torch.equal(forward(model), forward(reference))
    handle = offload_core.enable_offload(model, backend=backend(), **ENABLE_OPTIONS[strategy])
    assert torch.equal(forward(model), forward(reference))
    handle.disable()
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        assert torch.equal(a, b), name


def setup(operation: str, strategy: str):
    """(model, reference, the operation on the model, the handle the user holds or None)."""
    model, reference = build()
    options = ENABLE_OPTIONS[strategy]
    if operation == "enable":
        return model, reference, lambda: offload_core.enable_offload(model, backend=backend(), **options), None
    handle = offload_core.enable_offload(model, backend=backend(), **options)
    forward(model)  # the state after a first call: measured activations, learned orders
    if operation == "forward":
        return model, reference, lambda: forward(model), handle
    if operation == "backward":
        return model, reference, lambda: loss(model).backward(), handle
    return model, reference, handle.disable, handle


def points(operation: str, strategy: str) -> list[Point]:
    """The points reached by the operation, in the order first reached, on its second run (the
    first one also runs what happens once per process: lazy imports, caches)."""
    for _ in range(2):
        model, _, run, handle = setup(operation, strategy)
        tracer = Tracer()
        made = traced(tracer, run)
        (made if operation == "enable" else handle).disable()
    return list(tracer.reached)


def sample(reached: list[Point]) -> list[Point]:
    """Every point (the full sweep), or evenly spaced points of every file: up to ``PER_FILE`` of
    each file of ``PATH``, ``PER_OTHER_FILE`` of the others."""
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


#: what a point that left a lock held blocked at: later tests fail at once instead of blocking too
_held: list[str] = []


def in_time(work, what: str):
    """(``work()``'s result, None) or (None, what it raised), run on a new thread: the point's
    thread state is its own, and a lock left held fails the test, after ``DEADLINE`` seconds,
    naming where it blocked, instead of hanging it."""
    if _held:
        pytest.fail(f"not run: an earlier point left a lock held ({_held[0]})")
    outcome: list = []

    def run() -> None:
        try:
            outcome.append((work(), None))
        except BaseException as exc:  # noqa: BLE001 - handed to the sweep
            outcome.append((None, exc))

    worker = threading.Thread(target=run, name="interrupt-sweep", daemon=True)
    worker.start()
    worker.join(DEADLINE)
    if worker.is_alive():
        frame = sys._current_frames().get(worker.ident)
        stack = "".join(traceback.format_stack(frame)[-4:]) if frame is not None else ""
        _held.append(what)
        pytest.fail(f"{what}: still running after {DEADLINE:.0f} s (a lock left held?), at:\n{stack}")
    return outcome[0]


@pytest.mark.parametrize("operation", OPERATIONS)
@pytest.mark.parametrize("strategy", ENABLE_OPTIONS)
def test_an_interrupt_at_any_line_leaves_the_model_usable(strategy, operation, frozen_heap):
    reached, error = in_time(lambda: points(operation, strategy), "listing the points")
    if error is not None:
        raise error
    files = {f for f, _, _ in reached}
    assert len(files) > 3, files  # the path runs through the strategies, the handle and the weights
    if operation == "enable":  # the bookkeeping the hang and wrong counts came from
        assert {"labels.py", "slabs.py", "memory_accounting.py"} <= {os.path.basename(f) for f in files}
    chosen = sample(reached)
    assert {f for f, _, _ in chosen} == files  # every file of the path is covered
    failures = []
    fired = 0
    for where in chosen:
        point = f"{os.path.relpath(where[0], ROOT)}:{where[1]} (instruction {where[2]})"

        def interrupted(where=where):
            """The operation, interrupted at ``where``; then the next call on the same thread, and
            what is left on the thread after it (the next call undoes what an interrupted one left)."""
            before = counts()
            model, reference, run, handle = setup(operation, strategy)
            tracer = Tracer(where)
            try:
                made = traced(tracer, run)
                handle = made if operation == "enable" else handle
            except Injected:
                pass
            forward(model)
            return before, model, reference, handle, tracer.fired, thread_state()

        state, error = in_time(interrupted, f"{point}: the interrupted {operation}")
        if error is not None:
            failures.append(f"{point}: the operation raised {type(error).__name__}: {error}"[:300])
            continue
        before, model, reference, handle, hit, left = state
        fired += hit
        if left:
            failures.append(f"{point}: left on its thread: {', '.join(left)}")

        def recover(handle=handle, model=model, reference=reference) -> None:
            """On another thread than the interrupted one: a lock it left held blocks here."""
            if operation == "disable":  # the user calls disable() again: it completes
                handle.disable()
            assert_usable(model, reference, strategy)

        _, error = in_time(recover, f"{point}: the model's next use")
        if error is not None:
            failures.append(f"{point}: {type(error).__name__}: {error}"[:300])
        del state, model, reference, handle, recover
        after, _ = in_time(counts, f"{point}: the counts")
        if error is None and after != before:
            failures.append(f"{point}: (device, pinned) bytes counted {before} before, {after} after")
    assert fired >= len(chosen) * 0.9, (fired, len(chosen))
    print(f"{strategy} {operation}: injected at {len(chosen)} of {len(reached)} points reached")
    assert not failures, f"{len(failures)} of {len(chosen)} points ({len(reached)} reached):\n" + "\n".join(failures)
