"""What ``enable`` puts on the target itself, beside the parts' call wrappers: the handle mark
(with other libraries' weight-managing hooks refused from then on) and, for a pipeline, a
same-named subclass. Each is
an :class:`~offload_core.handle.Install`: taken off while a plain copy is made and by
``disable()``.

While offloading is on, a pipeline reports the backend's device as ``pipe.device`` and
``pipe._execution_device`` (so latents and embeddings are created there), one call runs at a time
(the handle's lock), a call whose components changed since enable is refused, diffusers' own
offloading methods are refused, and every call ends by swapping staged components out.
"""

from __future__ import annotations

import contextlib
from typing import Any

from torch import nn

from ..base.errors import OffloadConfigError, OffloadedModelError
from ..handle import HANDLE_ATTRIBUTE, OffloadHandle
from ..base.locks import locked
from ..interop.other_hooks import guard_registrations
from ..discovery.pipelines import pipeline_modules
from ..strategies.model_level import ModelLevelOffload
from ..strategies.part import CopyGuard


class Mark:
    """The install that marks the target as offloaded by ``handle`` (``HANDLE_ATTRIBUTE``). Taken
    off while a plain copy is made, so the copy is not "enabled". Installing it also makes sure
    diffusers' and accelerate's hook registration refuses the hooks that would move or re-cast
    the weights of a model an enabled handle owns (``other_hooks.guard_registrations``, process-wide:
    nothing to take off, a guard lets every module no handle owns through)."""

    def __init__(self, target: Any, roots: list[nn.Module], handle: OffloadHandle) -> None:
        self.target = target
        self.roots = roots
        self.handle = handle

    def install(self) -> None:
        guard_registrations()
        setattr(self.target, HANDLE_ATTRIBUTE, self.handle)

    def uninstall(self) -> None:
        self.target.__dict__.pop(HANDLE_ATTRIBUTE, None)


#: call arguments through which user code runs between denoising steps (and may change weights)
STEP_CALLBACKS = ("callback_on_step_end", "callback")


#: diffusers' own offloading: it moves the weights this library streams
PIPELINE_OFFLOAD_METHODS = ("enable_model_cpu_offload", "enable_sequential_cpu_offload", "enable_group_offload")


def check_components(pipe: Any, enabled: dict[str, nn.Module], handle: OffloadHandle) -> None:
    """Refuse a call when a component was replaced, added or removed since enable: the new one
    would run un-offloaded (on an accelerator, on the wrong device) while the handle still holds
    the old one's memory. Checked at every call, before any work."""
    now = dict(pipeline_modules(pipe))
    changed = sorted(n for n in {*enabled, *now} if enabled.get(n) is not now.get(n))
    if changed:
        raise OffloadedModelError(
            f"{type(pipe).__name__}: component(s) {', '.join(changed)} changed since enable_offload, so offloading "
            f"no longer covers them. Put the original back, or call handle.disable() and enable_offload(pipe) "
            f"again ({handle!r})"
        )


def _refuse_offload_method(name: str, handle: OffloadHandle):
    def refuse(self, *args, **kwargs):
        raise OffloadConfigError(
            f"{type(self).__name__}.{name}() would move the weights that offload-core streams ({handle!r}); "
            "use one or the other: call handle.disable() first"
        )

    return refuse


def _pipeline_subclass(cls: type, handle: OffloadHandle, parts: list, enabled: dict[str, nn.Module]) -> type:
    device = handle.backend.device()

    def __call__(self, *args, **kwargs):
        # one call at a time per handle; components stay on the device until the call ends; without
        # step callbacks no user code runs between steps, so the weights stay as they are
        check_components(self, enabled, handle)
        callbacks = any(kwargs.get(name) is not None for name in STEP_CALLBACKS)
        return locked(handle.lock, call, self, callbacks, args, kwargs)

    def call(self, callbacks: bool, args: tuple, kwargs: dict):  # with the handle's lock held
        with contextlib.nullcontext() if callbacks else handle.frozen():
            staged = [p for p in parts if isinstance(p, ModelLevelOffload)]
            for part in staged:
                part.begin_call()
            if handle.switch is not None:
                handle.switch.begin_call()
            with handle.measured_call():
                try:
                    return cls.__call__(self, *args, **kwargs)
                finally:
                    if handle.switch is not None:
                        handle.switch.end_call(_steps(self))
                    for part in staged:
                        part.end_call()

    namespace = {
        "__call__": __call__,
        "device": property(lambda self: device),
        "_execution_device": property(lambda self: device),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
        **{name: _refuse_offload_method(name, handle) for name in PIPELINE_OFFLOAD_METHODS if hasattr(cls, name)},
    }
    return type(cls.__name__, (cls,), namespace)


def _steps(pipe: Any) -> int:
    """The denoising steps the pipeline's last call made: its scheduler's timesteps."""
    timesteps = getattr(getattr(pipe, "scheduler", None), "timesteps", None)
    return len(timesteps) if timesteps is not None else 0


class PipelineClass:
    """The install that gives the pipeline instance a same-named subclass (its device, end-of-call
    release, the handle's lock, the component check, diffusers' own offloading refused) and plain
    copies; ``uninstall()`` restores the class. The subclass is made as it is first installed,
    inside the enable transaction, once the parts it runs are enabled."""

    def __init__(self, pipe: Any, handle: OffloadHandle, parts: list, enabled: dict[str, nn.Module]) -> None:
        self.pipe = pipe
        self.original = type(pipe)
        self.handle = handle
        self.parts = parts
        self.enabled = enabled
        self.subclass: type | None = None
        self._guard: CopyGuard | None = None

    def install(self) -> None:
        if self.subclass is None:
            self.subclass = _pipeline_subclass(self.original, self.handle, self.parts, self.enabled)
        self.pipe.__class__ = self.subclass
        if self._guard is None:
            self._guard = CopyGuard(self.pipe, self.handle.plain_copy)
            self._guard.install()

    def uninstall(self) -> None:
        self.pipe.__class__ = self.original
        if self._guard is not None:
            self._guard.remove()
            self._guard = None
