"""UNet pipelines of the sweep: Stable Diffusion 1.x and its variants (img2img, inpainting, ControlNet,
LCM, PAG, AnimateDiff), SDXL img2img and ControlNet, DeepFloyd IF and Kandinsky 2.2 (prior and decoder).

The UNets are two-level (8 and 16 channels) with one layer per block, and the VAE is the zoo's
two-level ``AutoencoderKL`` (a spatial factor of 2), so a 32-pixel image is a 16 x 16 latent.
"""

from __future__ import annotations

from typing import Any

from offload_core.tiny import encoders as enc
from offload_core.tiny import tokenizers as tok
from offload_core.tiny import vaes as vae
from offload_core.tiny.spec import PipelineSpec, TinyPipeline, _call, _finish, _reference_image, _seeded_components

CROSS_DIM = 16  # the CLIP text width, the UNets' cross-attention width


def _sd_unet(in_channels: int = 4, **extra: Any):
    from diffusers import UNet2DConditionModel

    config = dict(
        sample_size=16,
        in_channels=in_channels,
        out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        block_out_channels=(8, 16),
        layers_per_block=1,
        norm_num_groups=4,
        attention_head_dim=4,
        cross_attention_dim=CROSS_DIM,
    )
    return enc.finish(UNet2DConditionModel(**{**config, **extra}))


def _ddim():
    from diffusers import DDIMScheduler

    return DDIMScheduler(
        beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False,
        steps_offset=1,
    )


def _sd_components(seed: int, unet_in_channels: int = 4, **unet_extra: Any) -> dict[str, Any]:
    tokenizer = tok.clip_tokenizer()
    return {
        "tokenizer": tokenizer,
        "safety_checker": None,
        "feature_extractor": None,
        **_seeded_components(
            seed,
            text_encoder=lambda: enc.clip_text(tokenizer, hidden_size=CROSS_DIM, projection_dim=CROSS_DIM),
            vae=lambda: vae.autoencoder_kl(latent_channels=4),
            unet=lambda: _sd_unet(unet_in_channels, **unet_extra),
        ),
    }


def _mask_image(size: int = 32):
    """A white square (the region to repaint) on black."""
    from PIL import Image

    mask = Image.new("L", (size, size), 0)
    mask.paste(255, (size // 4, size // 4, 3 * size // 4, 3 * size // 4))
    return mask.convert("RGB")


def _sd(seed: int) -> TinyPipeline:
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline(scheduler=_ddim(), requires_safety_checker=False, **_sd_components(seed))
    return _finish("sd", pipe, _call(32, guidance_scale=1.0), "images")


def _sd_img2img(seed: int) -> TinyPipeline:
    from diffusers import StableDiffusionImg2ImgPipeline

    pipe = StableDiffusionImg2ImgPipeline(scheduler=_ddim(), requires_safety_checker=False, **_sd_components(seed))
    call = _call(32, image=_reference_image(32), strength=0.5, num_inference_steps=4, guidance_scale=1.0)
    del call["height"], call["width"]
    return _finish("sd-img2img", pipe, call, "images")


def _sd_inpaint(seed: int) -> TinyPipeline:
    from diffusers import StableDiffusionInpaintPipeline

    # noise latents + the 1-channel mask + the masked image's latents
    pipe = StableDiffusionInpaintPipeline(
        scheduler=_ddim(), requires_safety_checker=False, **_sd_components(seed, unet_in_channels=9)
    )
    call = _call(32, image=_reference_image(32), mask_image=_mask_image(32), guidance_scale=1.0)
    return _finish("sd-inpaint", pipe, call, "images")


def _controlnet():
    from diffusers import ControlNetModel

    return enc.finish(
        ControlNetModel(
            in_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=1,
            norm_num_groups=4,
            attention_head_dim=4,
            cross_attention_dim=CROSS_DIM,
            conditioning_embedding_out_channels=(8, 8),  # one 2x downsampling: the VAE's factor
        )
    )


def _sd_controlnet(seed: int) -> TinyPipeline:
    from diffusers import StableDiffusionControlNetPipeline

    components = {**_sd_components(seed), **_seeded_components(seed + 1, controlnet=_controlnet)}
    pipe = StableDiffusionControlNetPipeline(scheduler=_ddim(), requires_safety_checker=False, **components)
    return _finish("sd-controlnet", pipe, _call(32, image=_reference_image(32), guidance_scale=1.0), "images")


def _lcm(seed: int) -> TinyPipeline:
    from diffusers import LCMScheduler, LatentConsistencyModelPipeline

    # LCM distils guidance into the UNet: the guidance scale enters as a timestep-like embedding.
    components = _sd_components(seed, time_cond_proj_dim=8)
    pipe = LatentConsistencyModelPipeline(scheduler=LCMScheduler(), requires_safety_checker=False, **components)
    return _finish("lcm", pipe, _call(32, guidance_scale=6.0), "images")


def _sd_pag(seed: int) -> TinyPipeline:
    from diffusers import StableDiffusionPAGPipeline

    # Perturbed-attention guidance runs the UNet on a second batch whose self-attention is replaced.
    pipe = StableDiffusionPAGPipeline(
        scheduler=_ddim(), requires_safety_checker=False, pag_applied_layers=["mid"], **_sd_components(seed)
    )
    return _finish("sd-pag", pipe, _call(32, guidance_scale=1.0, pag_scale=3.0), "images")


def _animatediff(seed: int) -> TinyPipeline:
    from diffusers import AnimateDiffPipeline, MotionAdapter

    components = _sd_components(seed)
    del components["safety_checker"]
    components.update(
        _seeded_components(
            seed + 1,
            motion_adapter=lambda: enc.finish(
                MotionAdapter(
                    block_out_channels=(8, 16),
                    motion_layers_per_block=1,
                    motion_norm_num_groups=4,
                    motion_num_attention_heads=2,
                )
            ),
        )
    )
    pipe = AnimateDiffPipeline(scheduler=_ddim(), **components)
    return _finish("animatediff", pipe, _call(32, num_frames=2, guidance_scale=1.0), "frames")


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


def _sdxl_img2img(seed: int) -> TinyPipeline:
    from diffusers import StableDiffusionXLImg2ImgPipeline

    # The refiner setting: aesthetic-score conditioning off, both text encoders on.
    pipe = StableDiffusionXLImg2ImgPipeline(
        scheduler=_euler(), requires_aesthetics_score=False, **_sdxl_components(seed)
    )
    call = _call(32, image=_reference_image(32), strength=0.5, num_inference_steps=4, guidance_scale=1.0)
    del call["height"], call["width"]
    return _finish("sdxl-img2img", pipe, call, "images")


def _sdxl_controlnet(seed: int) -> TinyPipeline:
    from diffusers import ControlNetModel, StableDiffusionXLControlNetPipeline

    def controlnet():
        return enc.finish(
            ControlNetModel(
                in_channels=4,
                down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
                block_out_channels=(8, 16),
                layers_per_block=2,
                norm_num_groups=4,
                attention_head_dim=(2, 4),
                transformer_layers_per_block=(1, 2),
                use_linear_projection=True,
                cross_attention_dim=32,
                addition_embed_type="text_time",
                addition_time_embed_dim=8,
                projection_class_embeddings_input_dim=6 * 8 + 16,
                conditioning_embedding_out_channels=(8, 8),
            )
        )

    components = {**_sdxl_components(seed), **_seeded_components(seed + 2, controlnet=controlnet)}
    pipe = StableDiffusionXLControlNetPipeline(scheduler=_euler(), **components)
    return _finish("sdxl-controlnet", pipe, _call(32, image=_reference_image(32), guidance_scale=1.0), "images")


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
    "sd": PipelineSpec("StableDiffusionPipeline", "Stable Diffusion 1.x text-to-image; UNet, CLIP", ("unet",), _sd),
    "sd-img2img": PipelineSpec(
        "StableDiffusionImg2ImgPipeline", "Stable Diffusion image-to-image: VAE encode, then denoise", ("unet",),
        _sd_img2img,
    ),
    "sd-inpaint": PipelineSpec(
        "StableDiffusionInpaintPipeline", "Stable Diffusion inpainting: 9-channel UNet, mask", ("unet",), _sd_inpaint
    ),
    "sd-controlnet": PipelineSpec(
        "StableDiffusionControlNetPipeline", "Stable Diffusion with a ControlNet (resident beside the UNet)",
        ("unet",), _sd_controlnet,
    ),
    "lcm": PipelineSpec(
        "LatentConsistencyModelPipeline", "Latent consistency model: guidance as a UNet embedding", ("unet",), _lcm
    ),
    "sd-pag": PipelineSpec(
        "StableDiffusionPAGPipeline", "Stable Diffusion with perturbed-attention guidance", ("unet",), _sd_pag
    ),
    "animatediff": PipelineSpec(
        "AnimateDiffPipeline", "AnimateDiff: the UNet with motion modules (UNetMotionModel)", ("unet",), _animatediff
    ),
    "sdxl-img2img": PipelineSpec(
        "StableDiffusionXLImg2ImgPipeline", "SDXL image-to-image / refiner", ("unet",), _sdxl_img2img
    ),
    "sdxl-controlnet": PipelineSpec(
        "StableDiffusionXLControlNetPipeline", "SDXL with a ControlNet", ("unet",), _sdxl_controlnet
    ),
    "if": PipelineSpec("IFPipeline", "DeepFloyd IF stage I: pixel-space UNet, T5", ("unet",), _if),
    "kandinsky2.2": PipelineSpec(
        "KandinskyV22Pipeline", "Kandinsky 2.2 decoder: image-embedding UNet, MoVQ", ("unet",), _kandinsky22
    ),
    "kandinsky2.2-prior": PipelineSpec(
        "KandinskyV22PriorPipeline", "Kandinsky 2.2 prior: a one-block PriorTransformer, CLIP text and vision",
        ("prior",), _kandinsky22_prior,
    ),
}
