"""FLUX.1-family pipelines of the sweep: FLUX.1 text-to-image, image-to-image, inpainting, Kontext editing
and ControlNet, and Chroma.

The DiTs have one double-stream and one single-stream block, as in diffusers' fast tests: two block lists
of one block each. Latents come from the zoo's two-level VAE (4 channels, a spatial factor of 2) and are
packed 2 x 2, so a 16-pixel image is 16 tokens of 16 channels.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

from offload_core.tiny import encoders as enc
from offload_core.tiny import tokenizers as tok
from offload_core.tiny import vaes as vae
from offload_core.tiny.spec import PipelineSpec, TinyPipeline, _call, _finish, _reference_image, _seeded_components
from .sd import _mask_image

T5_DIM = 32  # the T5 width: the DiTs' joint attention width
CLIP_DIM = 16  # the CLIP width: FLUX.1's pooled projection


def _flux_dit(cls_name: str = "FluxTransformer2DModel", **extra: Any):
    import diffusers

    config = dict(
        patch_size=1,
        in_channels=16,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=8,
        num_attention_heads=2,
        joint_attention_dim=T5_DIM,
        axes_dims_rope=(2, 2, 4),
    )
    if cls_name != "ChromaTransformer2DModel":
        config["pooled_projection_dim"] = CLIP_DIM
    return enc.finish(getattr(diffusers, cls_name)(**{**config, **extra}))


def _vae():
    return vae.autoencoder_kl(latent_channels=4, shift_factor=0.06, scaling_factor=1.5)


def _flux_components(seed: int) -> dict[str, Any]:
    tokenizer, tokenizer_2 = tok.clip_tokenizer(), tok.t5_tokenizer()
    return {
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        **_seeded_components(
            seed,
            text_encoder=lambda: enc.clip_text(tokenizer, hidden_size=CLIP_DIM, projection_dim=CLIP_DIM),
            text_encoder_2=lambda: enc.t5_encoder(tokenizer_2, d_model=T5_DIM),
            vae=_vae,
            transformer=_flux_dit,
        ),
    }


def _scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler()


def _flux_call(**settings: Any) -> dict[str, Any]:
    return _call(16, guidance_scale=3.5, max_sequence_length=16, **settings)


#: key -> the FLUX.1 pipeline class on the same components, what it is, and its call's settings beside
#: ``_flux_call``'s (a function: the images are made afresh for each build)
FLUX1: dict[str, tuple[str, str, Callable[[], dict[str, Any]]]] = {
    "flux": ("FluxPipeline", "FLUX.1 text-to-image; CLIP and T5", dict),
    "flux-img2img": (
        "FluxImg2ImgPipeline", "FLUX.1 image-to-image",
        lambda: dict(image=_reference_image(16), strength=0.5, num_inference_steps=4),
    ),
    "flux-inpaint": (
        "FluxInpaintPipeline", "FLUX.1 inpainting",
        lambda: dict(image=_reference_image(16), mask_image=_mask_image(16), strength=0.8, num_inference_steps=3),
    ),
    # The reference image's tokens join the sequence. The output size is fitted to max_area (1024^2 by
    # default) and the reference image to Kontext's resolution buckets: both kept tiny here.
    "flux-kontext": (
        "FluxKontextPipeline", "FLUX.1 Kontext: reference-image tokens beside the latents",
        lambda: dict(image=_reference_image(16), max_area=16 * 16, _auto_resize=False, prompt="make the cat red"),
    ),
}


def _flux1(key: str, seed: int) -> TinyPipeline:
    import diffusers

    cls_name, _, settings = FLUX1[key]
    pipe = getattr(diffusers, cls_name)(scheduler=_scheduler(), **_flux_components(seed))
    return _finish(key, pipe, _flux_call(**settings()), "images")


def _flux_controlnet(seed: int) -> TinyPipeline:
    from diffusers import FluxControlNetPipeline

    components = {
        **_flux_components(seed),
        **_seeded_components(seed + 1, controlnet=lambda: _flux_dit("FluxControlNetModel")),
    }
    pipe = FluxControlNetPipeline(scheduler=_scheduler(), **components)
    call = _flux_call(control_image=_reference_image(16), controlnet_conditioning_scale=0.5)
    return _finish("flux-controlnet", pipe, call, "images")


def _chroma(seed: int) -> TinyPipeline:
    from diffusers import ChromaPipeline

    tokenizer = tok.t5_tokenizer()
    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=T5_DIM),
        vae=_vae,
        transformer=lambda: _flux_dit(
            "ChromaTransformer2DModel", approximator_hidden_dim=16, approximator_layers=1,
            approximator_num_channels=16,
        ),
    )
    pipe = ChromaPipeline(scheduler=_scheduler(), tokenizer=tokenizer, **components)
    # Chroma has real classifier-free guidance: a negative prompt and a second DiT pass.
    call = _call(16, negative_prompt="blurry", guidance_scale=4.0, max_sequence_length=16)
    return _finish("chroma", pipe, call, "images")


SPECS: dict[str, PipelineSpec] = {
    **{
        key: PipelineSpec(cls_name, description, ("transformer",), partial(_flux1, key))
        for key, (cls_name, description, _) in FLUX1.items()
    },
    "flux-controlnet": PipelineSpec(
        "FluxControlNetPipeline", "FLUX.1 with a FLUX ControlNet (resident beside the DiT)", ("transformer",),
        _flux_controlnet,
    ),
    "chroma": PipelineSpec(
        "ChromaPipeline", "Chroma: FLUX.1 layout with a modulation approximator, T5 only, real CFG",
        ("transformer",), _chroma,
    ),
}
