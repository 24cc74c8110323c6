"""diffusers pipelines as offload sees them: their components, sorted into kinds and grouped.

Components come from ``pipe.components`` and are sorted into kinds: ``dit`` (the denoisers),
``text_encoder`` (every prompt/image encoder), ``vae`` (decoders back to pixels or sound) and
``other``. The generic rule works on component names; ``PIPELINE_OVERRIDES`` fixes the pipelines
it gets wrong. The pipeline's own ``model_cpu_offload_seq`` gives the usual order of use. What
the enable path needs of its target is read here once, as an :class:`Inventory` that ``enable_offload``
makes and hands down, so that no layer below asks the target again. Pure functions of the pipeline
and the config: the enable transaction (``enable.py``) makes the parts, and the pipeline's subclass
while offloading is on is an install (``installs.py``).
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from typing import Any, Mapping

from torch import nn

from ..common.config import OffloadConfig
from . import find_blocks
from .blocks import no_blocks_hint
from ..base.errors import BlockDiscoveryError, OffloadConfigError

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


@dataclasses.dataclass(frozen=True)
class Inventory:
    """A target as the enable path sees it: whether it is a pipeline, the roots whose weights it
    holds (every ``nn.Module`` component of a pipeline), and its weight-holding components in their
    usual order of use with their kinds. A bare module is one component, a DiT named by its class."""

    target: Any
    pipeline: bool
    roots: tuple[nn.Module, ...]
    modules: tuple[tuple[str, nn.Module], ...]
    kinds: Mapping[str, str]

    @property
    def kind(self) -> str:
        """What :meth:`OffloadConfig.check_applies` takes: "pipeline" or "module"."""
        return "pipeline" if self.pipeline else "module"

    def components(self) -> list[tuple[str, nn.Module]]:
        """The weight-holding components; a pipeline with none has nothing to offload."""
        if not self.modules:
            raise ValueError(f"{type(self.target).__name__} has no component with weights to offload")
        return list(self.modules)

    def swap_groups(self) -> list[tuple[str, list]]:
        """Model-level swap groups: all encoders together, each DiT alone, all VAEs together, the rest alone."""
        groups: dict[str, list] = {}
        for name, module in self.modules:
            kind = self.kinds[name]
            key = kind if kind in ("text_encoder", "vae") else name
            groups.setdefault(key, []).append((name, module))
        return list(groups.items())


def inventory(target: Any) -> Inventory | None:
    """The inventory of a diffusers pipeline or an ``nn.Module``; None for anything else."""
    if is_pipeline(target):
        roots = tuple(m for m in target.components.values() if isinstance(m, nn.Module))
        return dataclasses.replace(pipeline_inventory(target, pipeline_modules(target)), roots=roots)
    if isinstance(target, nn.Module):
        name = type(target).__name__
        return Inventory(target, False, (target,), ((name, target),), {name: "dit"})
    return None


def pipeline_inventory(pipe: Any, modules: list[tuple[str, nn.Module]]) -> Inventory:
    """The inventory of a pipeline's ``(name, module)`` pairs; with ``pipe`` None (modules built
    on their own, as ``offload-core plan`` does for real-size configs), kinds read from the names."""
    return Inventory(pipe, True, (), tuple(modules), {name: component_kind(pipe, name) for name, _ in modules})


@dataclasses.dataclass
class LayerwiseLayout:
    """How layerwise offload covers a pipeline's components (see :func:`layerwise_layout`)."""

    streamed: list[tuple[str, nn.Module, list[tuple[str, nn.Module]]]]  # (name, component, its blocks)
    staged: list[tuple[str, list[tuple[str, nn.Module]]]]  # model-level groups without prefetch
    resident: list[tuple[str, nn.Module]]


def layerwise_layout(target: Inventory, config: OffloadConfig, modes: dict[str, str] | None = None
                     ) -> LayerwiseLayout:
    """Streamed components stream their blocks; one without blocks is staged like the VAE (onto
    the device around its use, dropped at the end of the call), so that no single component can
    fail the whole pipeline; the rest stays resident. Which are streamed: ``config.components``,
    or a device plan's ``modes`` (component name -> "streamed", "staged" or "resident"). A bare
    module is a pipeline of one DiT with no pipeline call around its forwards to stage it in:
    unless the plan keeps it resident its blocks are streamed, and without blocks it stays
    resident (with a warning, since nothing is offloaded)."""
    streamed = config.components or ("dit",)
    kinds = target.kinds
    if modes is None and "dit" not in kinds.values() and "dit" in streamed:
        raise OffloadConfigError(
            f"{type(target.target).__name__} has no DiT component to stream (components: {', '.join(kinds)})")
    layout = LayerwiseLayout([], [], [])
    for name, module in target.modules:
        kind = kinds[name]
        if modes is not None:
            mode = modes[name]
        elif kind in ("dit", "text_encoder") and kind in streamed:
            mode = "streamed"
        else:
            mode = "staged" if kind == "vae" and "vae" in streamed else "resident"
        if mode == "streamed" or mode == "staged" and not target.pipeline:
            # blocks= names the DiTs' block lists, as the plan read them
            blocks = _component_blocks(target, name, module, config.blocks if kind == "dit" else None, config)
            if blocks:
                layout.streamed.append((name, module, blocks))
            elif target.pipeline:
                layout.staged.append((name, [(name, module)]))
            else:
                layout.resident.append((name, module))
        elif mode == "staged":
            layout.staged.append((name, [(name, module)]))
        else:
            layout.resident.append((name, module))
    return layout


def _component_blocks(target: Inventory, name: str, module: nn.Module, attrs: tuple[str, ...] | None,
                      config: OffloadConfig) -> list[tuple[str, nn.Module]]:
    """The component's blocks; none (with one logged line) when its stack cannot be found. Block
    attributes the user passed explicitly (``blocks=``) must exist: a typo there is an error, and
    so is a bare module's stack that cannot be found (it has no other component to go on with)."""
    try:
        blocks = find_blocks(module, attrs)
        reason = "found no blocks to stream"
    except BlockDiscoveryError as exc:
        if attrs is not None or not target.pipeline:
            raise
        blocks, reason = [], str(exc)
    if blocks:
        return blocks
    if target.pipeline:
        logger.info("layerwise offload: %s (%s): %s, so it is staged onto the device around its use and dropped "
                    "after, like the VAE; %s", name, type(module).__name__, reason, no_blocks_hint(module))
    else:
        logger.warning("%s offload: %s has no blocks to stream, so nothing is offloaded: it stays resident on the "
                       "device. Name its block lists with the blocks= option (enable_offload(model, "
                       "blocks=[\"layers\"], ...)), or %s", config.strategy, name, no_blocks_hint(module))
    return blocks
