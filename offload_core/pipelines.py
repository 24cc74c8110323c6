"""diffusers pipeline integration: component discovery, grouping and the pipeline's device.

Components come from ``pipe.components`` and are sorted into kinds: ``dit`` (the denoisers),
``text_encoder`` (every prompt/image encoder), ``vae`` (decoders back to pixels or sound) and
``other``. The generic rule works on component names; ``PIPELINE_OVERRIDES`` fixes the pipelines
it gets wrong. The pipeline's own ``model_cpu_offload_seq`` gives the usual order of use.

While offloading is on, the pipeline reports the backend's device as ``pipe.device`` and
``pipe._execution_device`` (so latents and embeddings are created there), one call runs at a time
(the handle's lock), and every pipeline call ends by swapping staged components out. All of it is
done by giving the pipeline instance a same-named subclass, restored by ``disable()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from typing import TYPE_CHECKING, Any

from torch import nn

from .config import OffloadConfig
from .discovery import find_blocks
from .discovery.blocks import no_blocks_hint
from .errors import BlockDiscoveryError, OffloadConfigError, OffloadedModelError
from .strategies.model_level import ModelLevelOffload
from .strategies.part import CopyGuard

if TYPE_CHECKING:
    from .handle import OffloadHandle

logger = logging.getLogger(__name__)

KIND_PREFIXES = {
    "dit": ("transformer", "unet", "prior", "denoiser", "dit"),
    "text_encoder": ("text_encoder", "image_encoder", "vision_encoder", "prompt_encoder", "mllm", "language_model"),
    "vae": ("vae", "movq", "audio_vae", "vocoder"),
}
#: pipeline class name -> {component name: kind}, where the name rule is wrong
PIPELINE_OVERRIDES: dict[str, dict[str, str]] = {
    "Cosmos3OmniPipeline": {"sound_tokenizer": "vae"},
}


def is_pipeline(target: Any) -> bool:
    """True for a diffusers ``DiffusionPipeline``. Asked of every target, so it must not import
    diffusers' pipelines (over a second): if their base module is not loaded yet, no pipeline
    can exist."""
    module = sys.modules.get("diffusers.pipelines.pipeline_utils")
    return module is not None and isinstance(target, module.DiffusionPipeline)


def component_kind(pipe: Any, name: str) -> str:
    override = PIPELINE_OVERRIDES.get(type(pipe).__name__, {})
    if name in override:
        return override[name]
    for kind, prefixes in KIND_PREFIXES.items():
        if name.startswith(prefixes):
            return kind
    return "other"


def pipeline_modules(pipe: Any) -> list[tuple[str, nn.Module]]:
    """The pipeline's weight-holding components, in their usual order of use."""
    modules = {n: m for n, m in pipe.components.items() if isinstance(m, nn.Module) and any(True for _ in m.parameters())}
    seq = [n for n in (getattr(pipe, "model_cpu_offload_seq", None) or "").split("->") if n in modules]
    order = seq + [n for n in modules if n not in seq]
    return [(n, modules[n]) for n in order]


def model_level_groups(pipe: Any, modules: list[tuple[str, nn.Module]]) -> list[tuple[str, list]]:
    """Swap groups: all encoders together, each DiT alone, all VAEs together, the rest alone."""
    groups: dict[str, list] = {}
    for name, module in modules:
        kind = component_kind(pipe, name)
        key = kind if kind in ("text_encoder", "vae") else name
        groups.setdefault(key, []).append((name, module))
    return list(groups.items())


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
        with handle.lock, (contextlib.nullcontext() if callbacks else handle.frozen()):
            staged = [p for p in parts if isinstance(p, ModelLevelOffload)]
            for part in staged:
                part.begin_call()
            try:
                return cls.__call__(self, *args, **kwargs)
            finally:
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


class PipelineClass:
    """The install that gives the pipeline instance a same-named subclass (its device, end-of-call
    release, the handle's lock, the component check, diffusers' own offloading refused) and plain
    copies; ``uninstall()`` restores the class."""

    def __init__(self, pipe: Any, handle: OffloadHandle, parts: list, enabled: dict[str, nn.Module]) -> None:
        self.pipe = pipe
        self.original = type(pipe)
        self.subclass = _pipeline_subclass(self.original, handle, parts, enabled)
        self.handle = handle
        self._guard: CopyGuard | None = None

    def install(self) -> None:
        self.pipe.__class__ = self.subclass
        if self._guard is None:
            self._guard = CopyGuard(self.pipe, self.handle.plain_copy)

    def uninstall(self) -> None:
        self.pipe.__class__ = self.original
        if self._guard is not None:
            self._guard.remove()
            self._guard = None


@dataclasses.dataclass
class LayerwiseLayout:
    """How layerwise offload covers a pipeline's components (see :func:`layerwise_layout`)."""

    streamed: list[tuple[str, nn.Module, list[tuple[str, nn.Module]]]]  # (name, component, its blocks)
    staged: list[tuple[str, list[tuple[str, nn.Module]]]]  # model-level groups without prefetch
    resident: list[tuple[str, nn.Module]]


def layerwise_layout(pipe: Any, modules: list[tuple[str, nn.Module]], config: OffloadConfig) -> LayerwiseLayout:
    """Streamed components stream their blocks; one without blocks is staged like the VAE (onto
    the device around its use, dropped at the end of the call), so that no single component can
    fail the whole pipeline; the rest stays resident."""
    streamed = config.components or ("dit",)
    layout = LayerwiseLayout([], [], [])
    kinds = {name: component_kind(pipe, name) for name, _ in modules}
    if "dit" not in kinds.values() and "dit" in streamed:
        raise OffloadConfigError(f"{type(pipe).__name__} has no DiT component to stream (components: {', '.join(kinds)})")
    for name, module in modules:
        kind = kinds[name]
        if kind in ("dit", "text_encoder") and kind in streamed:
            blocks = _component_blocks(name, module, config.blocks if kind == "dit" else None)
            if blocks:
                layout.streamed.append((name, module, blocks))
            else:
                layout.staged.append((name, [(name, module)]))
        elif kind == "vae" and "vae" in streamed:
            layout.staged.append((name, [(name, module)]))
        else:
            layout.resident.append((name, module))
    return layout


def _component_blocks(name: str, module: nn.Module, attrs: tuple[str, ...] | None) -> list[tuple[str, nn.Module]]:
    """The component's blocks; none (with one logged line) when its stack cannot be found. Block
    attributes the user passed explicitly (``blocks=``) must exist: a typo there is an error."""
    try:
        blocks = find_blocks(module, attrs)
        reason = "found no blocks to stream"
    except BlockDiscoveryError as exc:
        if attrs is not None:
            raise
        blocks, reason = [], str(exc)
    if not blocks:
        logger.info("layerwise offload: %s (%s): %s, so it is staged onto the device around its use and dropped "
                    "after, like the VAE; %s", name, type(module).__name__, reason, no_blocks_hint(module))
    return blocks
