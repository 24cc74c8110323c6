"""UNet pipelines of the sweep: Stable Diffusion 1.x and its variants (img2img, inpainting, ControlNet,
LCM, PAG, AnimateDiff), SDXL img2img and ControlNet, DeepFloyd IF and Kandinsky 2.2 (prior and decoder).

The UNets are two-level (8 and 16 channels) with one layer per block, and the VAE is the zoo's
two-level ``AutoencoderKL`` (a spatial factor of 2), so a 32-pixel image is a 16 x 16 latent.
The SD 1.x and SDXL pipelines share their components and are rows of one table, :data:`UNET_PIPELINES`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Mapping

from offload_core.tiny import encoders as enc
from offload_core.tiny import tokenizers as tok
from offload_core.tiny import vaes as vae
from offload_core.tiny.spec import PipelineSpec, TinyPipeline, _call, _finish, _reference_image, _seeded_components

CROSS_DIM = 16  # the CLIP text width, the UNets' cross-attention width

#: the SD 1.x UNet's down blocks, which its ControlNet copies
DOWN_BLOCKS: dict[str, Any] = dict(
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    block_out_channels=(8, 16),
    layers_per_block=1,
    norm_num_groups=4,
    attention_head_dim=4,
    cross_attention_dim=CROSS_DIM,
)


def _sd_unet(in_channels: int = 4, **extra: Any):
    from diffusers import UNet2DConditionModel

    config = dict(
        DOWN_BLOCKS,
        sample_size=16,
        in_channels=in_channels,
        out_channels=4,
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    )
    return enc.finish(UNet2DConditionModel(**{**config, **extra}))


def _ddim():
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False,
        steps_offset=1,
    )


def _lcm_scheduler():
    from diffusers import LCMScheduler

    return LCMScheduler()


def _sd_components(seed: int, **unet_extra: Any) -> dict[str, Any]:
    tokenizer = tok.clip_tokenizer()
    return {
        "tokenizer": tokenizer,
        **_seeded_components(
            seed,
            text_encoder=lambda: enc.clip_text(tokenizer, hidden_size=CROSS_DIM, projection_dim=CROSS_DIM),
            vae=lambda: vae.autoencoder_kl(latent_channels=4),
            unet=lambda: _sd_unet(**unet_extra),
        ),
    }


def _no_safety_checker() -> dict[str, Any]:
    """The SD 1.x pipelines' constructor arguments for running without a safety checker."""
    return dict(safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def _mask_image(size: int = 32):
    """A white square (the region to repaint) on black."""
    from PIL import Image

    mask = Image.new("L", (size, size), 0)
    mask.paste(255, (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
    return mask.convert("RGB")


def _controlnet(**extra: Any):
    from diffusers import ControlNetModel

    config = dict(
        DOWN_BLOCKS,
        in_channels=4,
        conditioning_embedding_out_channels=(8, 8),  # one 2x downsampling: the VAE's factor
    )
    return enc.finish(ControlNetModel(**{**config, **extra}))


def _sdxl_controlnet():
    """A ControlNet in the layout of the zoo's SDXL UNet: text-time embeddings, two layers per block."""
    return _controlnet(
        layers_per_block=2,
        attention_head_dim=(2, 4),
        transformer_layers_per_block=(1, 2),
        use_linear_projection=True,
        cross_attention_dim=32,
        addition_embed_type="text_time",
        addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + 16,
    )


def _motion_adapter():
    from diffusers import MotionAdapter

    return enc.finish(
        MotionAdapter(
            block_out_channels=(8, 16),
            motion_layers_per_block=1,
            motion_norm_num_groups=4,
            motion_num_attention_heads=2,
        )
    )


def _sdxl_components(seed: int, **unet_overrides: Any) -> dict[str, Any]:
    from offload_core.tiny.transformers import build_dit

    tokenizer, tokenizer_2 = tok.clip_tokenizer(), tok.clip_tokenizer()
    return {
        "tokenizer": tokenizer,
        "tokenizer_2": tokenizer_2,
        **_seeded_components(seed, text_encoder=lambda: enc.clip_text(tokenizer, hidden_size=16, projection_dim=16)),
        **_seeded_components(
            seed + 1,
            text_encoder_2=lambda: enc.clip_text_with_projection(tokenizer_2, hidden_size=16, projection_dim=16),
        ),
        **_seeded_components(
            seed,
            vae=lambda: vae.autoencoder_kl(latent_channels=4),
            unet=lambda: build_dit("sdxl-unet", **unet_overrides),
        ),
    }


def _euler():
    from diffusers import EulerDiscreteScheduler

    return EulerDiscreteScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", steps_offset=1, timestep_spacing="leading"
    )


def _no_extra(seed: int) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class UNetPipeline:
    """One row of :data:`UNET_PIPELINES`: a diffusers pipeline class on the shared SD 1.x (or SDXL) components."""

    key: str
    cls_name: str  # the diffusers pipeline class
    description: str
    #: the call's settings beside ``_call(32, ...)``'s (a function: the images are made afresh for each build)
    settings: Callable[[], dict[str, Any]]
    #: ``(seed, **unet)`` -> the tokenizers, text encoders, VAE and UNet
    components: Callable[..., dict[str, Any]] = _sd_components
    unet: Mapping[str, Any] = field(default_factory=dict)  # the UNet's config beside that of ``components``
    scheduler: Callable[[], Any] = _ddim
    extra: Callable[[int], dict[str, Any]] = _no_extra  # seed -> further components (a ControlNet, a motion adapter)
    pipe_kwargs: Callable[[], dict[str, Any]] = _no_safety_checker  # the pipeline constructor's further arguments
    sized: bool = True  # False: the call has no height and width, the output takes the input image's size
    output: str = "images"  # the field of the pipeline output that holds the images / frames


UNET_PIPELINES: tuple[UNetPipeline, ...] = (
    UNetPipeline(
        "sd", "StableDiffusionPipeline", "Stable Diffusion 1.x text-to-image; UNet, CLIP",
        lambda: dict(guidance_scale=1.0),
    ),
    UNetPipeline(
        "sd-img2img", "StableDiffusionImg2ImgPipeline", "Stable Diffusion image-to-image: VAE encode, then denoise",
        lambda: dict(image=_reference_image(32), strength=0.5, num_inference_steps=4, guidance_scale=1.0),
        sized=False,
    ),
    UNetPipeline(
        "sd-inpaint", "StableDiffusionInpaintPipeline", "Stable Diffusion inpainting: 9-channel UNet, mask",
        lambda: dict(image=_reference_image(32), mask_image=_mask_image(32), guidance_scale=1.0),
        # noise latents + the 1-channel mask + the masked image's latents
        unet=dict(in_channels=9),
    ),
    UNetPipeline(
        "sd-controlnet", "StableDiffusionControlNetPipeline",
        "Stable Diffusion with a ControlNet (resident beside the UNet)",
        lambda: dict(image=_reference_image(32), guidance_scale=1.0),
        extra=lambda seed: _seeded_components(seed + 1, controlnet=_controlnet),
    ),
    UNetPipeline(
        "lcm", "LatentConsistencyModelPipeline", "Latent consistency model: guidance as a UNet embedding",
        lambda: dict(guidance_scale=6.0),
        # LCM distils guidance into the UNet: the guidance scale enters as a timestep-like embedding.
        unet=dict(time_cond_proj_dim=8),
        scheduler=_lcm_scheduler,
    ),
    UNetPipeline(
        "sd-pag", "StableDiffusionPAGPipeline", "Stable Diffusion with perturbed-attention guidance",
        lambda: dict(guidance_scale=1.0, pag_scale=3.0),
        # Perturbed-attention guidance runs the UNet on a second batch whose self-attention is replaced.
        pipe_kwargs=lambda: {**_no_safety_checker(), "pag_applied_layers": ["mid"]},
    ),
    UNetPipeline(
        "animatediff", "AnimateDiffPipeline", "AnimateDiff: the UNet with motion modules (UNetMotionModel)",
        lambda: dict(num_frames=2, guidance_scale=1.0),
        extra=lambda seed: _seeded_components(seed + 1, motion_adapter=_motion_adapter),
        pipe_kwargs=lambda: dict(feature_extractor=None),  # AnimateDiff has no safety checker
        output="frames",
    ),
    UNetPipeline(
        "sdxl-img2img", "StableDiffusionXLImg2ImgPipeline", "SDXL image-to-image / refiner",
        lambda: dict(image=_reference_image(32), strength=0.5, num_inference_steps=4, guidance_scale=1.0),
        components=_sdxl_components,
        scheduler=_euler,
        # The refiner setting: aesthetic-score conditioning off, both text encoders on.
        pipe_kwargs=lambda: dict(requires_aesthetics_score=False),
        sized=False,
    ),
    UNetPipeline(
        "sdxl-controlnet", "StableDiffusionXLControlNetPipeline", "SDXL with a ControlNet",
        lambda: dict(image=_reference_image(32), guidance_scale=1.0),
        components=_sdxl_components,
        scheduler=_euler,
        extra=lambda seed: _seeded_components(seed + 2, controlnet=_sdxl_controlnet),
        pipe_kwargs=dict,  # SDXL pipelines have no safety checker
    ),
)


def _unet_pipeline(row: UNetPipeline, seed: int) -> TinyPipeline:
    import diffusers

    components = {**row.components(seed, **row.unet), **row.extra(seed)}
    pipe = getattr(diffusers, row.cls_name)(scheduler=row.scheduler(), **row.pipe_kwargs(), **components)
    call = _call(32, **row.settings())
    if not row.sized:
        del call["height"], call["width"]
    return _finish(row.key, pipe, call, row.output)


def _if(seed: int) -> TinyPipeline:
    from diffusers import DDPMScheduler, IFPipeline, UNet2DConditionModel

    tokenizer = tok.t5_tokenizer(model_max_length=77)

    def unet():
        return enc.finish(
            UNet2DConditionModel(
                sample_size=16,
                layers_per_block=1,
                block_out_channels=(8, 16),
                down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
                mid_block_type="UNetMidBlock2DSimpleCrossAttn",
                up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
                in_channels=3,  # IF denoises pixels
                out_channels=6,  # and predicts a variance
                norm_num_groups=4,
                cross_attention_dim=32,  # a multiple of the 32 groups of the cross-attention norm
                encoder_hid_dim=16,  # the T5 width
                attention_head_dim=8,
                addition_embed_type="text",
                addition_embed_type_num_heads=2,
                cross_attention_norm="group_norm",
                resnet_time_scale_shift="scale_shift",
                act_fn="gelu",
            )
        )

    components = _seeded_components(seed, text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=16), unet=unet)
    scheduler = DDPMScheduler(
        beta_schedule="squaredcos_cap_v2",
        thresholding=True,
        dynamic_thresholding_ratio=0.95,
        sample_max_value=1.0,
        variance_type="learned_range",
    )
    pipe = IFPipeline(
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        watermarker=None,
        requires_safety_checker=False,
        **components,
    )
    return _finish("if", pipe, _call(16, guidance_scale=1.0, clean_caption=False), "images")


EMBED_DIM = 16  # Kandinsky 2.2's CLIP image embedding width


def _kandinsky22(seed: int) -> TinyPipeline:
    import torch
    from diffusers import DDIMScheduler, KandinskyV22Pipeline, UNet2DConditionModel, VQModel

    def unet():
        return enc.finish(
            UNet2DConditionModel(
                in_channels=4,
                out_channels=8,  # mean and variance
                addition_embed_type="image",
                down_block_types=("ResnetDownsampleBlock2D", "SimpleCrossAttnDownBlock2D"),
                up_block_types=("SimpleCrossAttnUpBlock2D", "ResnetUpsampleBlock2D"),
                mid_block_type="UNetMidBlock2DSimpleCrossAttn",
                block_out_channels=(8, 16),
                layers_per_block=1,
                norm_num_groups=4,
                encoder_hid_dim=EMBED_DIM,
                encoder_hid_dim_type="image_proj",
                cross_attention_dim=16,
                attention_head_dim=4,
                resnet_time_scale_shift="scale_shift",
            )
        )

    def movq():
        return enc.finish(
            VQModel(
                block_out_channels=(32, 32),  # MoVQ's spatial norm has a fixed 32 groups
                down_block_types=("DownEncoderBlock2D", "AttnDownEncoderBlock2D"),
                up_block_types=("AttnUpDecoderBlock2D", "UpDecoderBlock2D"),
                in_channels=3,
                out_channels=3,
                latent_channels=4,
                layers_per_block=1,
                norm_num_groups=8,
                norm_type="spatial",
                num_vq_embeddings=12,
                vq_embed_dim=4,
            )
        )

    components = _seeded_components(seed, unet=unet, movq=movq)
    scheduler = DDIMScheduler(
        beta_schedule="linear", beta_start=0.00085, beta_end=0.012, clip_sample=False, set_alpha_to_one=False,
        steps_offset=1,
    )
    pipe = KandinskyV22Pipeline(scheduler=scheduler, **components)
    g = torch.Generator("cpu").manual_seed(seed)
    embeds = torch.randn(1, EMBED_DIM, generator=g)
    call = _call(32, image_embeds=embeds, negative_image_embeds=torch.zeros_like(embeds), guidance_scale=1.0)
    del call["prompt"]
    return _finish("kandinsky2.2", pipe, call, "images")


def _kandinsky22_prior(seed: int) -> TinyPipeline:
    from diffusers import KandinskyV22PriorPipeline, PriorTransformer, UnCLIPScheduler
    from transformers import CLIPImageProcessorPil, CLIPVisionConfig, CLIPVisionModelWithProjection

    tokenizer = tok.clip_tokenizer()

    def prior():
        return enc.finish(
            PriorTransformer(
                num_attention_heads=2, attention_head_dim=8, embedding_dim=EMBED_DIM, num_layers=1
            )
        )

    def image_encoder():
        config = CLIPVisionConfig(
            hidden_size=16, projection_dim=EMBED_DIM, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=32, image_size=32, patch_size=16,
        )
        return enc.finish(CLIPVisionModelWithProjection(config))

    components = _seeded_components(
        seed,
        prior=prior,
        image_encoder=image_encoder,
        text_encoder=lambda: enc.clip_text_with_projection(tokenizer, hidden_size=16, projection_dim=EMBED_DIM),
    )
    processor = CLIPImageProcessorPil(crop_size=32, size=32)
    scheduler = UnCLIPScheduler(
        variance_type="fixed_small_log", prediction_type="sample", num_train_timesteps=1000, clip_sample=True,
        clip_sample_range=10.0,
    )
    pipe = KandinskyV22PriorPipeline(tokenizer=tokenizer, scheduler=scheduler, image_processor=processor, **components)
    call = {"prompt": "a cat sitting on a bench", "num_inference_steps": 2, "guidance_scale": 1.0, "output_type": "pt"}
    return _finish("kandinsky2.2-prior", pipe, call, "image_embeds")


SPECS: dict[str, PipelineSpec] = {
    **{
        row.key: PipelineSpec(row.cls_name, row.description, ("unet",), partial(_unet_pipeline, row))
        for row in UNET_PIPELINES
    },
    "if": PipelineSpec("IFPipeline", "DeepFloyd IF stage I: pixel-space UNet, T5", ("unet",), _if),
    "kandinsky2.2": PipelineSpec(
        "KandinskyV22Pipeline", "Kandinsky 2.2 decoder: image-embedding UNet, MoVQ", ("unet",), _kandinsky22
    ),
    "kandinsky2.2-prior": PipelineSpec(
        "KandinskyV22PriorPipeline", "Kandinsky 2.2 prior: a one-block PriorTransformer, CLIP text and vision",
        ("prior",), _kandinsky22_prior,
    ),
}
