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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from . import encoders as enc
from . import tokenizers as tok
from .transformers import build_dit

# --------------------------------------------------------------------------------------------------------------
# Public types
# --------------------------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------------------------
# Builders, one per pipeline
# --------------------------------------------------------------------------------------------------------------


def _flux2(seed: int, text_layers: int = 2, name: str = "flux2", **dit_overrides: Any) -> TinyPipeline:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    tokenizer = tok.mistral_tokenizer()
    # Flux2 stacks the hidden states of text-encoder layers (all of the tiny encoder's) as the DiT's text input.
    out_layers = tuple(range(1, text_layers + 1))
    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.mistral3(tokenizer, hidden_size=16, num_layers=text_layers),
        vae=enc.autoencoder_kl_flux2,
        transformer=lambda: build_dit("flux2", joint_attention_dim=16 * text_layers, **dit_overrides),
    )
    pipe = Flux2Pipeline(scheduler=FlowMatchEulerDiscreteScheduler(), tokenizer=tokenizer, **components)
    call = _call(
        16,
        guidance_scale=4.0,  # guidance-distilled: an embedding, not a second pass
        max_sequence_length=16,
        text_encoder_out_layers=out_layers,
    )
    return _finish(name, pipe, call, "images")


def _longcat_image(seed: int) -> TinyPipeline:
    from diffusers import FlowMatchEulerDiscreteScheduler, LongCatImagePipeline

    tokenizer = tok.qwen2_tokenizer()
    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.qwen2_5_vl(tokenizer, hidden_size=16),
        # The pipeline hard-codes 16 latent channels.
        vae=lambda: enc.autoencoder_kl(latent_channels=16, shift_factor=0.1, scaling_factor=1.5),
        transformer=lambda: build_dit("longcat-image"),
    )
    pipe = LongCatImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        tokenizer=tokenizer,
        text_processor=enc.qwen2_vl_processor(tokenizer),
        **components,
    )
    # The pipeline pads every prompt to a fixed 512 tokens; 32 keeps the tiny text stream short.
    pipe.tokenizer_max_length = 32
    call = _call(
        16,
        guidance_scale=1.0,
        enable_prompt_rewrite=False,  # rewriting would run text generation with the tiny LM
    )
    return _finish("longcat-image", pipe, call, "images")


def _joyimage_edit(seed: int, **dit_overrides: Any) -> TinyPipeline:
    from diffusers import FlowMatchEulerDiscreteScheduler, JoyImageEditPipeline

    tokenizer = tok.qwen2_tokenizer()
    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.qwen3_vl(tokenizer, hidden_size=16),
        vae=lambda: enc.autoencoder_kl_wan(z_dim=4),
        transformer=lambda: build_dit("joyimage-edit", **dit_overrides),
    )
    pipe = JoyImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(),
        tokenizer=tokenizer,
        processor=enc.qwen3_vl_processor(tokenizer),
        **components,
    )
    # JoyImage snaps every request to one of its 1024-pixel resolution buckets; a tiny run keeps the size asked.
    pipe.vae_image_processor = _exact_size_joyimage_processor_cls()(vae_scale_factor=pipe.vae_scale_factor_spatial)
    call = _call(
        32,
        image=_reference_image(32),
        prompt="make the cat red",
        guidance_scale=1.0,
        max_sequence_length=32,
    )
    return _finish("joyimage-edit", pipe, call, "images")


@functools.lru_cache(maxsize=None)
def _exact_size_joyimage_processor_cls() -> type:
    """JoyImage's image processor without its resolution buckets (created on first use: it imports diffusers).

    ``JoyImageEditImageProcessor.get_default_height_width`` snaps every request, explicit sizes included, to
    the nearest 1024-pixel bucket; a tiny run must keep the tiny size it asks for. Nothing else changes.
    """
    from diffusers.pipelines.joyimage.image_processor import JoyImageEditImageProcessor

    def get_default_height_width(self, image, height=None, width=None):
        if height is not None and width is not None:
            return height, width
        return JoyImageEditImageProcessor.get_default_height_width(self, image, height, width)

    return type(
        "ExactSizeJoyImageEditImageProcessor",
        (JoyImageEditImageProcessor,),
        {"get_default_height_width": get_default_height_width, "__module__": __name__},
    )


def _ovis_image(seed: int) -> TinyPipeline:
    from diffusers import FlowMatchEulerDiscreteScheduler, OvisImagePipeline

    tokenizer = tok.qwen2_tokenizer()
    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.qwen3(tokenizer, hidden_size=16),
        vae=lambda: enc.autoencoder_kl(latent_channels=4, shift_factor=0.1, scaling_factor=1.5),
        transformer=lambda: build_dit("ovis-image"),
    )
    pipe = OvisImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), tokenizer=tokenizer, **components)
    call = _call(16, guidance_scale=1.0, max_sequence_length=16)
    return _finish("ovis-image", pipe, call, "images")


def _qwen_image(seed: int) -> TinyPipeline:
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    tokenizer = tok.qwen2_tokenizer()
    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.qwen2_5_vl(tokenizer, hidden_size=16),
        vae=lambda: enc.autoencoder_kl_qwen_image(z_dim=4),
        transformer=lambda: build_dit("qwen-image"),
    )
    pipe = QwenImagePipeline(scheduler=FlowMatchEulerDiscreteScheduler(), tokenizer=tokenizer, **components)
    call = _call(32, true_cfg_scale=1.0, max_sequence_length=16)
    return _finish("qwen-image", pipe, call, "images")


def _sdxl(seed: int) -> TinyPipeline:
    from diffusers import EulerDiscreteScheduler, StableDiffusionXLPipeline

    tokenizer = tok.clip_tokenizer()
    tokenizer_2 = tok.clip_tokenizer()
    components = {
        **_seeded_components(seed, text_encoder=lambda: enc.clip_text(tokenizer, hidden_size=16, projection_dim=16)),
        **_seeded_components(
            seed + 1,
            text_encoder_2=lambda: enc.clip_text_with_projection(tokenizer_2, hidden_size=16, projection_dim=16),
        ),
        **_seeded_components(
            seed, vae=lambda: enc.autoencoder_kl(latent_channels=4), unet=lambda: build_dit("sdxl-unet")
        ),
    }
    scheduler = EulerDiscreteScheduler(
        beta_start=0.00085,
        beta_end=0.012,
        beta_schedule="scaled_linear",
        steps_offset=1,
        timestep_spacing="leading",
    )
    pipe = StableDiffusionXLPipeline(tokenizer=tokenizer, tokenizer_2=tokenizer_2, scheduler=scheduler, **components)
    call = _call(32, guidance_scale=1.0)
    return _finish("sdxl", pipe, call, "images")


def _sd3(seed: int) -> TinyPipeline:
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    tokenizer, tokenizer_2, tokenizer_3 = tok.clip_tokenizer(), tok.clip_tokenizer(), tok.t5_tokenizer()
    components = {
        **_seeded_components(
            seed, text_encoder=lambda: enc.clip_text_with_projection(tokenizer, hidden_size=16, projection_dim=16)
        ),
        **_seeded_components(
            seed + 1,
            text_encoder_2=lambda: enc.clip_text_with_projection(tokenizer_2, hidden_size=16, projection_dim=16),
        ),
        **_seeded_components(seed + 2, text_encoder_3=lambda: enc.t5_encoder(tokenizer_3, d_model=32)),
        **_seeded_components(
            seed,
            vae=lambda: enc.autoencoder_kl(latent_channels=4, shift_factor=0.06, scaling_factor=1.5),
            transformer=lambda: build_dit("sd3"),
        ),
    }
    pipe = StableDiffusion3Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        tokenizer_3=tokenizer_3,
        **components,
    )
    call = _call(32, guidance_scale=1.0, max_sequence_length=16)
    return _finish("sd3", pipe, call, "images")


def _wan_scheduler():
    """Wan 2.2's sampler: UniPC over flow-matching sigmas. With two steps the timesteps are ~999 and ~750."""
    from diffusers import UniPCMultistepScheduler

    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)


# Wan 2.2 A14B switches from the high-noise expert (transformer) to the low-noise expert (transformer_2) at
# boundary_ratio * 1000. The tiny runs use a boundary between the two timesteps, so each expert runs once.
WAN_T2V_BOUNDARY_RATIO = 0.875
WAN_I2V_BOUNDARY_RATIO = 0.9
# Wan 2.2 I2V feeds the DiT noise latents, a 4-channel first-frame mask and the image latents (4 + 4 + 4).
WAN22_I2V_IN_CHANNELS = 12


def _wan22_components(seed: int, **dit_overrides: Any) -> dict[str, Any]:
    """Wan 2.2 A14B's text encoder, VAE and two expert DiTs (the second drawn from ``seed + 1``, so they differ)."""
    tokenizer = tok.t5_tokenizer()
    return {
        "tokenizer": tokenizer,
        **_seeded_components(
            seed,
            text_encoder=lambda: enc.umt5_encoder(tokenizer, d_model=16),
            vae=lambda: enc.autoencoder_kl_wan(z_dim=4),
            transformer=lambda: build_dit("wan-t2v", **dit_overrides),
        ),
        **_seeded_components(seed + 1, transformer_2=lambda: build_dit("wan-t2v", **dit_overrides)),
    }


def _wan22_call(**settings: Any) -> dict[str, Any]:
    """A five-frame Wan 2.2 call; both experts run without classifier-free guidance."""
    return _call(32, num_frames=5, guidance_scale=1.0, guidance_scale_2=1.0, max_sequence_length=16, **settings)


def _wan22_t2v(seed: int) -> TinyPipeline:
    from diffusers import WanPipeline

    pipe = WanPipeline(scheduler=_wan_scheduler(), boundary_ratio=WAN_T2V_BOUNDARY_RATIO, **_wan22_components(seed))
    return _finish("wan2.2-t2v", pipe, _wan22_call(), "frames")


def _tolerate_missing_ftfy() -> None:
    """Let diffusers' Wan I2V prompt cleaning run without the optional ``ftfy`` package.

    ``pipeline_wan_i2v.basic_clean`` calls ``ftfy.fix_text`` unconditionally although the module imports
    ``ftfy`` only when it is installed (``pipeline_wan`` checks ``is_ftfy_available()`` first). Without
    ``ftfy`` every prompt fails with a NameError. For the plain ASCII prompts of the zoo ``fix_text`` is the
    identity, so an identity stand-in is installed in that module only, and only when ``ftfy`` is missing.
    """
    import types

    from diffusers.pipelines.wan import pipeline_wan_i2v

    if not hasattr(pipeline_wan_i2v, "ftfy"):
        pipeline_wan_i2v.ftfy = types.SimpleNamespace(fix_text=lambda text: text)


def _wan22_i2v(seed: int) -> TinyPipeline:
    from diffusers import WanImageToVideoPipeline

    _tolerate_missing_ftfy()

    # Wan 2.2 I2V has no CLIP image encoder: the image enters only as VAE latents concatenated to the noise.
    pipe = WanImageToVideoPipeline(
        scheduler=_wan_scheduler(),
        image_processor=None,
        image_encoder=None,
        boundary_ratio=WAN_I2V_BOUNDARY_RATIO,
        **_wan22_components(seed, in_channels=WAN22_I2V_IN_CHANNELS),
    )
    return _finish("wan2.2-i2v", pipe, _wan22_call(image=_reference_image(32)), "frames")


def _cosmos3_omni(seed: int, **dit_overrides: Any) -> TinyPipeline:
    from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

    tokenizer = tok.qwen2_tokenizer()
    components = _seeded_components(
        seed,
        vae=lambda: enc.autoencoder_kl_wan(z_dim=4),
        transformer=lambda: build_dit("cosmos3-omni", **dit_overrides),
    )
    # The safety checker needs the external `cosmos_guardrail` package and model downloads: left out.
    pipe = Cosmos3OmniPipeline(
        text_tokenizer=tokenizer,
        scheduler=UniPCMultistepScheduler(),
        sound_tokenizer=None,
        safety_checker=None,
        enable_safety_checker=False,
        **components,
    )
    call = _call(
        32,
        negative_prompt=NEGATIVE_PROMPT,
        num_frames=1,
        guidance_scale=1.0,
        enable_safety_check=False,
    )
    return _finish("cosmos3-omni", pipe, call, "video")


# --------------------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------------------

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
