"""How a strategy runs its work around a module's calls, outside any ``torch.compile`` region.

A strategy's per-call work (wait for a block's weights, queue the next copies, swap a component in)
has side effects on streams and host state that a compiled graph must not capture: Dynamo would
either trace it (baking one call's decisions into the graph) or break the graph in the middle of
the module. So the work runs *around* the module call, never inside it:

* ``module._compiled_call_impl`` (what ``nn.Module.__call__`` runs instead of ``_call_impl`` once
  ``module.compile()`` has been called) becomes a wrapper that does the work, then runs the module:
  its own compiled function if it has one, else the plain ``_call_impl``. A block compiled in place
  (``block.compile()``, diffusers' ``compile_repeated_blocks()``, before or after ``enable``) then
  runs its work eagerly and its compiled graph whole, ``fullgraph=True`` included.
* ``module.compile`` is shadowed so that compiling in place after ``enable`` keeps the wrapper
  outside the new compiled function.
* The wrapper is ``torch.compiler.disable``-d: when a compiled *parent* reaches the module (a
  whole-model ``torch.compile``), Dynamo stops the graph there and runs the work eagerly, and the
  module's own frames are compiled on their own, once per distinct block code and shapes. The
  work runs through its disabled wrappers only while Dynamo is active on the thread (a frame
  evaluation callback is installed); an eager call skips them.
* ``forward`` is pinned in the instance dictionary (the class's own bound method, so nothing
  changes for an eager call): without it Dynamo inlines a plain module's ``forward`` directly,
  bypassing ``__call__`` and with it this wrapper.

The call runs under the handle's lock (one call at a time per offloaded model), and ``after`` runs
whatever happens inside (an exception, Ctrl-C), told whether the call failed, so a strategy's
state is never left half-way.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import types
from typing import Any, Callable

import torch
from torch import nn

from ..base.errors import ExportError
from .common import to_device

logger = logging.getLogger(__name__)

_REASON = (
    "offload-core streams this module's weights: its offload step runs between compiled graphs. "
    "For one graph per block use regional compilation (block.compile(fullgraph=True) or "
    "model.compile_repeated_blocks(fullgraph=True)); see docs/compatibility.md"
)


def compile_disabled(fn: Callable, recursive: bool = True) -> Callable:
    """``fn`` under ``torch.compiler.disable``, with the reason Dynamo shows at the graph break
    where this torch accepts one (``reason=`` is newer than the oldest torch we support, which
    raises ``TypeError`` for it). Looked up at each call, at enable time: cheap, and a test can
    stand in an older torch.

    A bound method is disabled as its function, then bound again: before torch 2.8,
    ``recursive=False`` marks the function it is given with an attribute, which a bound method
    cannot take (and it skips the function's code, the same for every instance)."""
    if inspect.ismethod(fn):
        return types.MethodType(compile_disabled(fn.__func__, recursive), fn.__self__)
    disable = torch.compiler.disable
    if "reason" in inspect.signature(disable).parameters:
        return disable(fn, recursive=recursive, reason=_REASON)
    return disable(fn, recursive=recursive)


#: the frame evaluation callback Dynamo installs while it compiles (or runs compiled code);
#: missing on a torch without it, where the work always goes through the disabled wrappers
_eval_frame_callback = getattr(torch._C._dynamo.eval_frame, "get_eval_frame_callback", None)


def _compiling_frames() -> bool:
    """Whether Dynamo may be looking at the frames called from here: it is tracing this one, or
    a compiled parent is running. Only then must the work run in frames it is told to skip:
    their wrappers cost about a microsecond each per call, on every block. (While tracing, the
    first test is a constant and the callback, which Dynamo cannot trace, is not asked.)"""
    return torch.compiler.is_compiling() or _eval_frame_callback is None or _eval_frame_callback() is not None


#: whether ``torch.export`` is tracing (torch 2.7 and later; on older torch export is not told
#: apart, and fails with torch's own error)
_exporting = getattr(torch.compiler, "is_exporting", lambda: False)


class CallWrapper:
    """Runs ``before()`` ahead of every call of ``module`` and ``after(failed)`` once it returns or
    raises, holding ``lock``, with the tensor inputs moved to ``device`` when one is given.
    ``remove()`` restores the module."""

    def __init__(
        self,
        module: nn.Module,
        before: Callable[[], None] | None = None,
        after: Callable[[bool], None] | None = None,
        device: torch.device | None = None,
        lock: Any = None,
    ) -> None:
        self.module = module
        self._lock = lock if lock is not None else contextlib.nullcontext()
        self._work_before = before
        self._device = device
        self._enter = compile_disabled(self._prepare)
        self._after = compile_disabled(after) if after is not None else None
        self._after_eager = after
        self._inner = module.__dict__.get("_compiled_call_impl")  # compiled in place before enable
        self._call = compile_disabled(self._run, recursive=False)
        self._compiled_work = compile_disabled(self._work, recursive=False)
        self._entry = self._checked_call  # one bound method, so that remove() recognises it
        self._pinned_forward = "forward" not in module.__dict__

    def install(self) -> None:
        """Wrap the module. Apart from the constructor, so that the wrapper is registered for its
        ``remove()`` before it changes the module: an interrupt in between is undone too."""
        module = self.module
        if self._pinned_forward:
            module.forward = module.forward
        module._compiled_call_impl = self._entry
        module.compile = self._compile

    def _checked_call(self, *args: Any, **kwargs: Any) -> Any:
        """The call, refused while ``torch.export`` traces it (outside the disabled frame, which
        export would reject with a message naming neither offloading nor its fix)."""
        if _exporting():
            raise ExportError(
                f"torch.export cannot trace {type(self.module).__name__} while it is offloaded: its weights move "
                "between host and device around every call. Call handle.disable() first, export the plain model, "
                "then enable offloading again"
            )
        if _compiling_frames():
            return self._call(self._compiled_work, self._enter, self._after, args, kwargs)
        # eager: nothing would trace the work, so its disabled wrappers are skipped
        return self._run(self._work, self._prepare, self._after_eager, args, kwargs)

    def _prepare(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if self._work_before is not None:
            self._work_before()
        if self._device is not None:
            return to_device(args, self._device), to_device(kwargs, self._device)
        return args, kwargs

    def _run(self, work: Callable, enter: Callable, after: Callable[[bool], None] | None, args: tuple,
             kwargs: dict) -> Any:
        # ``work`` holding the lock, the with statement on one line (offload_core.base.locks): no
        # interrupt leaves the handle's lock held. Under Dynamo this frame and ``work``'s are
        # skipped (``work`` is then the disabled wrapper), and the frames they call are compiled.
        with self._lock: return work(enter, after, args, kwargs)  # noqa: E701

    def _work(self, enter: Callable, after: Callable[[bool], None] | None, args: tuple, kwargs: dict) -> Any:
        # ``after`` captured now: a strategy that re-packs inside ``before`` removes this wrapper,
        # and the call that began here must still end with its ``after``. The work is in the two
        # disabled calls, and the module's own frames between them are compiled as usual.
        failed = True
        try:
            args, kwargs = enter(args, kwargs)
            inner = self._inner
            output = inner(*args, **kwargs) if inner is not None else self.module._call_impl(*args, **kwargs)
            failed = False
        finally:
            if after is not None:
                after(failed)
        return output

    def _compile(self, *args: Any, **kwargs: Any) -> None:
        """``nn.Module.compile`` for a wrapped module: compile its call, keep the wrapper outside."""
        self._inner = torch.compile(self.module._call_impl, *args, **kwargs)
        logger.debug("%s compiled in place; offload work stays outside its graph", type(self.module).__name__)

    def remove(self) -> None:
        """Unwrap; a compilation done while wrapped stays with the module. The wrapper's own
        references are dropped too: its wrapped methods refer back to it, and such a cycle would
        keep the strategy (and the memory it still holds) alive until the next garbage collection."""
        state = self.module.__dict__
        if self._entry is not None and state.get("_compiled_call_impl") is self._entry:
            if self._inner is not None:
                state["_compiled_call_impl"] = self._inner
            else:
                del state["_compiled_call_impl"]
        if state.get("compile") == self._compile:
            del state["compile"]
        forward = state.get("forward")
        if self._pinned_forward and getattr(forward, "__func__", None) is type(self.module).forward:
            del state["forward"]
        # last, once the module is restored: an interrupted call can be made again
        self._work_before = self._enter = self._after = self._after_eager = None
        self._call = self._entry = self._compiled_work = None


def calls_running(modules) -> int:
    """How many wrapped calls of ``modules`` are running on this thread's stack (the caller's
    own included). A strategy counts its calls in progress itself; the count it keeps is checked
    against this (only when it says a call is in progress: rare) so that a count an interrupt tore
    (Ctrl-C inside the work after a call) is repaired by the next call."""
    ids = {id(m) for m in modules}
    code = CallWrapper._run.__code__
    count = 0
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is code and id(frame.f_locals["self"].module) in ids:
            count += 1
        frame = frame.f_back
    return count
