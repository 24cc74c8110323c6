"""diffusers pipeline integration: component discovery, grouping and the pipeline's device.

Components come from ``pipe.components`` and are sorted into kinds: ``dit`` (the denoisers),
``text_encoder`` (every prompt/image encoder), ``vae`` (decoders back to pixels or sound) and
``other``. The generic rule works on component names; ``PIPELINE_OVERRIDES`` fixes the pipelines
it gets wrong. The pipeline's own ``model_cpu_offload_seq`` gives the usual order of use.

While offloading is on, the pipeline reports the backend's device as ``pipe.device`` and
``pipe._execution_device`` (so latents and embeddings are created there), and every pipeline call
ends by swapping staged components out. Both are done by giving the pipeline instance a
same-named subclass, restored by ``disable()``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import torch
from torch import nn

from .backend import DeviceBackend
from .config import OffloadConfig, OffloadConfigError
from .discovery import BlockDiscoveryError, find_blocks
from .discovery.blocks import no_blocks_hint
from .handle import OffloadHandle
from .hostmem.placement import plan_placement
from .strategies.common import Transaction
from .strategies import streaming_part
from .strategies.model_level import ModelLevelOffload
from .strategies.resident import ResidentModules

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


def _pipeline_subclass(cls: type, handle_device: torch.device, on_call_end) -> type:
    def __call__(self, *args, **kwargs):
        try:
            return cls.__call__(self, *args, **kwargs)
        finally:
            on_call_end()

    namespace = {
        "__call__": __call__,
        "device": property(lambda self: handle_device),
        "_execution_device": property(lambda self: handle_device),
        "__module__": cls.__module__,
        "__qualname__": cls.__qualname__,
        "__doc__": cls.__doc__,
    }
    return type(cls.__name__, (cls,), namespace)


def enable_on_pipeline(pipe: Any, config: OffloadConfig, backend: DeviceBackend) -> OffloadHandle:
    modules = pipeline_modules(pipe)
    if not modules:
        raise ValueError(f"{type(pipe).__name__} has no component with weights to offload")
    baseline = backend.memory_allocated()
    backend.reset_peak_memory_stats()
    parts: list = []
    with Transaction() as txn:
        if config.strategy == "model":
            parts.append(ModelLevelOffload(model_level_groups(pipe, modules), backend))
        else:
            parts.extend(_layerwise_parts(pipe, modules, config, backend))
        placement = plan_placement(parts, config, backend)
        placement.attach(parts, txn)
        for part in parts:
            part.enable(txn)
        staged = [p for p in parts if isinstance(p, ModelLevelOffload)]
        original = type(pipe)

        def on_call_end() -> None:
            for part in staged:
                part.release_all()

        pipe.__class__ = _pipeline_subclass(original, backend.device(), on_call_end)
        txn.on_rollback(lambda: setattr(pipe, "__class__", original))
    undo = [lambda: setattr(pipe, "__class__", original)]
    return OffloadHandle(pipe, config.strategy, backend, parts, baseline, undo, placement=placement)


def _layerwise_parts(pipe: Any, modules, config: OffloadConfig, backend: DeviceBackend) -> list:
    """Streamed components stream their blocks; one without blocks is staged like the VAE (onto
    the device around its use, dropped at the end of the call), so that no single component can
    fail the whole pipeline; the rest stays resident."""
    streamed = config.components or ("dit",)
    parts: list = []
    resident: list[tuple[str, nn.Module]] = []
    staged: list[tuple[str, list]] = []
    kinds = {name: component_kind(pipe, name) for name, _ in modules}
    if "dit" not in kinds.values() and "dit" in streamed:
        raise OffloadConfigError(f"{type(pipe).__name__} has no DiT component to stream (components: {', '.join(kinds)})")
    for name, module in modules:
        kind = kinds[name]
        if kind in ("dit", "text_encoder") and kind in streamed:
            blocks = _component_blocks(name, module, config.blocks if kind == "dit" else None)
            if blocks:
                parts.append(streaming_part(module, blocks, config, backend))
                parts[-1].label = name  # the timeline names blocks "transformer_2.blocks.3"
            else:
                staged.append((name, [(name, module)]))
        elif kind == "vae" and "vae" in streamed:
            staged.append((name, [(name, module)]))
        else:
            resident.append((name, module))
    if staged:
        parts.append(ModelLevelOffload(staged, backend, prefetch=False))
    if resident:
        parts.append(ResidentModules(resident, backend))
    return parts


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
