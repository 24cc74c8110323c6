"""Builders of the tiny video pipelines (Wan 2.2 text- and image-to-video, Cosmos 3 omni)."""

from __future__ import annotations

from typing import Any

from . import encoders as enc
from . import tokenizers as tok
from . import vaes as vae
from .spec import NEGATIVE_PROMPT, TinyPipeline, _call, _finish, _reference_image, _seeded_components
from .transformers import build_dit


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
            vae=lambda: vae.autoencoder_kl_wan(z_dim=4),
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
        vae=lambda: vae.autoencoder_kl_wan(z_dim=4),
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
