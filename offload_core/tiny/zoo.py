"""Tiny, randomly initialised diffusers pipelines for the supported-model table (docs/models.md).

Each pipeline is a real diffusers ``DiffusionPipeline`` of the named class, with every model shrunk to hidden
sizes of 8 to 32 and two blocks per block list, so that a full call (text encoding, two denoising steps, VAE
decode) takes well under a second on a CPU. They exist so that offloading can be tested end to end against the
real pipeline code: its component discovery, its call order, its hooks and its device handling.

Determinism: ``build_pipeline(name, seed)`` builds every component under :func:`~.encoders.seeded`, so two
builds with the same seed have identical weights; :meth:`TinyPipeline.run` always passes a CPU
``torch.Generator`` seeded with ``seed``, so two runs give ``torch.equal`` outputs. The generator stays on the
CPU even when an offload backend changes the pipeline's execution device (the fake backend keeps tensors on the
CPU; a real accelerator accepts CPU generators in diffusers' ``randn_tensor``).

Classifier-free guidance is switched off where the pipeline allows it (guidance scale 1): it would only double
the transformer calls without exercising anything new.
"""

from __future__ import annotations

import functools

from .images import _flux2, _joyimage_edit, _longcat_image, _ovis_image, _qwen_image, _sd3, _sdxl
from .spec import PipelineSpec, TinyPipeline
from .videos import _cosmos3_omni, _wan22_i2v, _wan22_t2v

_T = ("transformer",)
_T2 = ("transformer", "transformer_2")

PIPELINES: dict[str, PipelineSpec] = {
    "flux2": PipelineSpec("Flux2Pipeline", "FLUX.2 text-to-image; Mistral3 text encoder", _T, _flux2),
    "longcat-image": PipelineSpec(
        "LongCatImagePipeline", "LongCat-Image text-to-image; Qwen2.5-VL text encoder", _T, _longcat_image
    ),
    "joyimage-edit": PipelineSpec(
        "JoyImageEditPipeline", "JoyImage image editing; Qwen3-VL encoder, Wan VAE", _T, _joyimage_edit
    ),
    "ovis-image": PipelineSpec("OvisImagePipeline", "Ovis-Image text-to-image; Qwen3 text encoder", _T, _ovis_image),
    "qwen-image": PipelineSpec(
        "QwenImagePipeline", "Qwen-Image text-to-image; Qwen2.5-VL text encoder", _T, _qwen_image
    ),
    "sdxl": PipelineSpec("StableDiffusionXLPipeline", "SDXL text-to-image; UNet, two CLIP encoders", ("unet",), _sdxl),
    "sd3": PipelineSpec("StableDiffusion3Pipeline", "SD3 text-to-image; MMDiT, two CLIP encoders and T5", _T, _sd3),
    "wan2.2-t2v": PipelineSpec(
        "WanPipeline", "Wan 2.2 A14B text-to-video; high- and low-noise expert DiTs", _T2, _wan22_t2v
    ),
    "wan2.2-i2v": PipelineSpec(
        "WanImageToVideoPipeline", "Wan 2.2 A14B image-to-video; two expert DiTs, image as VAE latents", _T2,
        _wan22_i2v,
    ),
    "cosmos3-omni": PipelineSpec(
        "Cosmos3OmniPipeline", "Cosmos 3 omni text-to-image/video; one mixture-of-transformers model", _T,
        _cosmos3_omni,
    ),
}


#: Pipelines built to show something rather than to test a row of the table. ``flux2-deep``, the default of
#: ``offload-core run``, is FLUX.2 with a DiT of 8 double and 16 single blocks of width 64: its blocks hold about
#: 90% of the pipeline's weights (in the zoo's FLUX.2 the text encoder dwarfs them), so layerwise streaming keeps
#: a small fraction of them on the device; a call still takes a fraction of a second on a CPU.
DEMOS: dict[str, PipelineSpec] = {
    "flux2-deep": PipelineSpec(
        "Flux2Pipeline", "FLUX.2 with a 24-block DiT holding most of the weights (the demo)", _T,
        functools.partial(
            _flux2, name="flux2-deep", num_layers=8, num_single_layers=16, num_attention_heads=4,
            attention_head_dim=16, axes_dims_rope=(4, 4, 4, 4),
        ),
    ),
}


def build_pipeline(name: str, seed: int = 0) -> TinyPipeline:
    """Build the tiny pipeline ``name`` (a key of :data:`PIPELINES` or :data:`DEMOS`) with weights drawn from
    ``seed``."""
    spec = PIPELINES.get(name) or DEMOS.get(name)
    if spec is None:
        raise KeyError(f"unknown tiny pipeline {name!r}; known: {', '.join([*DEMOS, *PIPELINES])}")
    return spec.build(seed)
