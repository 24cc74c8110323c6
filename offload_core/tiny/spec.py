"""What a tiny pipeline is (:class:`TinyPipeline`, :class:`PipelineSpec`), how one is called (:func:`run`), and
the pieces every builder shares: seeded components, the zoo's prompt and call settings, a reference image."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import encoders as enc


@dataclass
class TinyPipeline:
    """A built tiny pipeline and the keyword arguments of a cheap, complete call."""

    name: str
    pipe: Any  # diffusers.DiffusionPipeline
    call_kwargs: dict[str, Any]
    output_attr: str  # the field of the pipeline output that holds the images / frames

    def run(self, seed: int = 0, **overrides: Any) -> torch.Tensor:
        """Call the pipeline with a CPU generator seeded with ``seed``; return the images or frames as a tensor."""
        return run(self, seed, **overrides)


@dataclass(frozen=True)
class PipelineSpec:
    """One row of the zoo: the diffusers pipeline class, what it is, and how to build it."""

    cls_name: str
    description: str
    denoisers: tuple[str, ...]  # pipeline attributes holding the DiT(s) / UNet, in the order they run
    build: Callable[[int], TinyPipeline] = field(repr=False, compare=False)


def run(tiny: TinyPipeline, seed: int = 0, **overrides: Any) -> torch.Tensor:
    """Run ``tiny`` once with ``generator=torch.Generator("cpu").manual_seed(seed)``.

    ``overrides`` replace entries of ``tiny.call_kwargs`` for this call only. The result is the pipeline's
    image / video output as a CPU ``torch.Tensor`` (numpy outputs are converted, lists are stacked).
    """
    kwargs = {**tiny.call_kwargs, **overrides}
    generator = torch.Generator("cpu").manual_seed(seed)
    # Some pipelines also draw from the global RNG (JoyImage-Edit samples its reference-image latents without
    # the generator), so the global CPU RNG is seeded too, on a forked state that is restored afterwards.
    with enc.seeded(seed), torch.no_grad():
        output = tiny.pipe(**kwargs, generator=generator)
    return as_tensor(getattr(output, tiny.output_attr))


def as_tensor(value: Any) -> torch.Tensor:
    """A pipeline's pixels (tensor, numpy array, PIL image, or lists of them) as one CPU tensor."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    if isinstance(value, (list, tuple)):
        return torch.stack([as_tensor(v) for v in value])
    if hasattr(value, "getpixel"):  # a PIL image: channels last, uint8
        return torch.from_numpy(np.array(value.convert("RGB")))
    raise TypeError(f"cannot read pixels from a pipeline output of type {type(value).__name__}")


def _finish(name: str, pipe, call_kwargs: dict[str, Any], output_attr: str) -> TinyPipeline:
    pipe.set_progress_bar_config(disable=True)
    return TinyPipeline(name=name, pipe=pipe, call_kwargs=call_kwargs, output_attr=output_attr)


def _reference_image(size: int = 32):
    """A deterministic RGB gradient as a PIL image: the input of the image-conditioned pipelines."""
    from PIL import Image

    ramp = np.linspace(0, 255, size, dtype=np.float32)
    pixels = np.stack(
        [np.add.outer(ramp, ramp) / 2, np.add.outer(ramp, ramp[::-1]) / 2, np.tile(ramp, (size, 1))], axis=-1
    )
    return Image.fromarray(pixels.astype(np.uint8))  # (H, W, 3) uint8: RGB


PROMPT = "a cat sitting on a bench"
NEGATIVE_PROMPT = "blurry, low quality"


def _seeded_components(seed: int, **factories: Callable[[], Any]) -> dict[str, Any]:
    """``{name: factory()}``, each component built under its own ``enc.seeded(seed)``, in the order given.

    Seeding every component afresh makes its weights depend on the seed alone, not on what was built before it.
    """
    components = {}
    for name, factory in factories.items():
        with enc.seeded(seed):
            components[name] = factory()
    return components


def _call(size: int, **settings: Any) -> dict[str, Any]:
    """The keyword arguments of a cheap call: the zoo's prompt, ``size`` x ``size`` pixels, two denoising steps
    and a tensor output; ``settings`` add to or replace these."""
    return {"prompt": PROMPT, "height": size, "width": size, "num_inference_steps": 2, "output_type": "pt", **settings}
