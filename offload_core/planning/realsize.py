"""Real-size pipelines on the meta device, for plans without a download: FLUX.2-dev, Wan2.2-T2V-A14B
and Qwen-Image, each component built from the installed diffusers / transformers classes with the
values of the published ``config.json`` of the model's diffusers repository on the Hugging Face
Hub (``black-forest-labs/FLUX.2-dev``, ``Wan-AI/Wan2.2-T2V-A14B-Diffusers``, ``Qwen/Qwen-Image``),
written out here. Every weight is counted in bfloat16, the dtype those checkpoints ship and run in.

Building one takes about a second: the meta device allocates nothing.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

#: FLUX.2-dev: transformer/config.json (Flux2Transformer2DModel), about 32B parameters
FLUX2_DEV_TRANSFORMER = dict(
    patch_size=1, in_channels=128, out_channels=None, num_layers=8, num_single_layers=48, attention_head_dim=128,
    num_attention_heads=48, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, eps=1e-6, guidance_embeds=True,
)
#: FLUX.2-dev: text_encoder/config.json (Mistral3ForConditionalGeneration: Mistral Small 3.x, 24B)
FLUX2_DEV_TEXT_ENCODER = dict(
    text_config=dict(model_type="mistral", hidden_size=5120, intermediate_size=32768, num_hidden_layers=40,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=131072,
                     max_position_embeddings=131072, rope_theta=1e9, rms_norm_eps=1e-5),
    vision_config=dict(model_type="pixtral", hidden_size=1024, intermediate_size=4096, num_hidden_layers=24,
                       num_attention_heads=16, head_dim=64, image_size=1540, patch_size=14),
    spatial_merge_size=2, multimodal_projector_bias=False, projector_hidden_act="gelu", tie_word_embeddings=False,
)
#: FLUX.2-dev: vae/config.json (AutoencoderKLFlux2)
FLUX2_DEV_VAE = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=32,
                     patch_size=(2, 2))
#: Wan2.2-T2V-A14B: transformer/config.json and transformer_2/config.json (the high- and low-noise
#: experts, WanTransformer3DModel), about 14B parameters each
WAN22_TRANSFORMER = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)
#: Wan2.2-T2V-A14B: text_encoder/config.json (UMT5EncoderModel: umt5-xxl's encoder)
WAN22_TEXT_ENCODER = dict(d_model=4096, d_ff=10240, d_kv=64, num_layers=24, num_heads=64, vocab_size=256384,
                          feed_forward_proj="gated-gelu", relative_attention_num_buckets=32,
                          relative_attention_max_distance=128)
#: Wan2.2-T2V-A14B: vae/config.json (AutoencoderKLWan, the Wan 2.1 VAE)
WAN22_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, temperal_downsample=[False, True, True])
#: Qwen-Image: transformer/config.json (QwenImageTransformer2DModel), about 20B parameters
QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, guidance_embeds=False, axes_dims_rope=(16, 56, 56),
)
#: Qwen-Image: text_encoder/config.json (Qwen2_5_VLForConditionalGeneration: Qwen2.5-VL-7B-Instruct)
QWEN_IMAGE_TEXT_ENCODER = dict(
    text_config=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                     num_key_value_heads=4, vocab_size=152064, max_position_embeddings=128000, rope_theta=1e6,
                     tie_word_embeddings=False),
    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584,
                       patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                       fullatt_block_indexes=[7, 15, 23, 31], in_chans=3, hidden_act="silu"),
    tie_word_embeddings=False,
)
#: Qwen-Image: vae/config.json (AutoencoderKLQwenImage)
QWEN_IMAGE_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                      temperal_downsample=[False, True, True])


def _diffusers(cls_name: str, config: dict[str, Any]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import diffusers

        return getattr(diffusers, cls_name)(**config)

    return build


def _transformers(cls_name: str, config_name: str, config: dict[str, Any]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, cls_name)(getattr(transformers, config_name)(**config))

    return build


#: pipeline name -> (what it is, [(component name, builder)] in order of use)
PIPELINES: dict[str, tuple[str, list[tuple[str, Callable[[], nn.Module]]]]] = {
    "real:flux2-dev": ("FLUX.2-dev (Flux2Pipeline): 32B DiT, Mistral Small 24B text encoder", [
        ("text_encoder", _transformers("Mistral3ForConditionalGeneration", "Mistral3Config", FLUX2_DEV_TEXT_ENCODER)),
        ("transformer", _diffusers("Flux2Transformer2DModel", FLUX2_DEV_TRANSFORMER)),
        ("vae", _diffusers("AutoencoderKLFlux2", FLUX2_DEV_VAE)),
    ]),
    "real:wan2.2-t2v-a14b": ("Wan2.2-T2V-A14B (WanPipeline): two 14B expert DiTs, umt5-xxl text encoder", [
        ("text_encoder", _transformers("UMT5EncoderModel", "UMT5Config", WAN22_TEXT_ENCODER)),
        ("transformer", _diffusers("WanTransformer3DModel", WAN22_TRANSFORMER)),
        ("transformer_2", _diffusers("WanTransformer3DModel", WAN22_TRANSFORMER)),
        ("vae", _diffusers("AutoencoderKLWan", WAN22_VAE)),
    ]),
    "real:qwen-image": ("Qwen-Image (QwenImagePipeline): 20B DiT, Qwen2.5-VL-7B text encoder", [
        ("text_encoder", _transformers("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
                                       QWEN_IMAGE_TEXT_ENCODER)),
        ("transformer", _diffusers("QwenImageTransformer2DModel", QWEN_IMAGE_TRANSFORMER)),
        ("vae", _diffusers("AutoencoderKLQwenImage", QWEN_IMAGE_VAE)),
    ]),
}


def build_modules(name: str) -> list[tuple[str, nn.Module]]:
    """The ``(component name, module)`` pairs of the real-size pipeline ``name``, on the meta device in
    bfloat16."""
    if name not in PIPELINES:
        raise KeyError(f"unknown real-size pipeline {name!r}; known: {', '.join(PIPELINES)}")
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16, not cast after (diffusers warns of a cast)
    try:
        with torch.device("meta"):
            return [(component, build()) for component, build in PIPELINES[name][1]]
    finally:
        torch.set_default_dtype(dtype)
