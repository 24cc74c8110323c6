"""Builders of the tiny image pipelines (FLUX.2, LongCat-Image, JoyImage-Edit, Ovis-Image, Qwen-Image, SDXL, SD3)."""

from __future__ import annotations

import functools
from typing import Any

from . import encoders as enc
from . import tokenizers as tok
from . import vaes as vae
from .spec import TinyPipeline, _call, _finish, _reference_image, _seeded_components
from .transformers import build_dit


def _flux2(seed: int, text_layers: int = 2, name: str = "flux2", **dit_overrides: Any) -> TinyPipeline:
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    tokenizer = tok.mistral_tokenizer()
    # Flux2 stacks the hidden states of text-encoder layers (all of the tiny encoder's) as the DiT's text input.
    out_layers = tuple(range(1, text_layers + 1))
    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.mistral3(tokenizer, hidden_size=16, num_layers=text_layers),
        vae=vae.autoencoder_kl_flux2,
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
        vae=lambda: vae.autoencoder_kl(latent_channels=16, shift_factor=0.1, scaling_factor=1.5),
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
        vae=lambda: vae.autoencoder_kl_wan(z_dim=4),
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
        vae=lambda: vae.autoencoder_kl(latent_channels=4, shift_factor=0.1, scaling_factor=1.5),
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
        vae=lambda: vae.autoencoder_kl_qwen_image(z_dim=4),
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
            seed, vae=lambda: vae.autoencoder_kl(latent_channels=4), unet=lambda: build_dit("sdxl-unet")
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
            vae=lambda: vae.autoencoder_kl(latent_channels=4, shift_factor=0.06, scaling_factor=1.5),
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
