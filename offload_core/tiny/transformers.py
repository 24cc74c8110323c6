"""The tiny diffusers denoisers (DiTs and the SDXL UNet) inside the tiny pipelines: their configs, and
:func:`build_dit`.

Every model has hidden sizes of 8 to 32 and two or three blocks per block list (an odd total where
the class has one list, so that streaming wraps around a ring whose length the slots do not divide).
The test suite builds the same models on their own, with inputs for one forward pass
(``tests/denoisers.py``), so the DiT inside a tiny pipeline is the model it tests alone.
"""

from __future__ import annotations

from typing import Any

import torch

from .encoders import finish

# --------------------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------------------

# Each DiT: two heads of dimension 8 (inner dim 16), two blocks per block list, RoPE axes summing to the head
# dimension. Input widths match the tiny VAEs of .encoders (4 latent channels; 2x2 packing where the real
# pipeline packs).

# Wan's text-to-video DiT; the image-to-video entry below adds the image path to it.
_WAN: dict[str, Any] = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=8,
    in_channels=4,
    out_channels=4,
    text_dim=16,
    freq_dim=16,
    ffn_dim=32,
    num_layers=3,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=32,
)

CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "flux2": (
        "Flux2Transformer2DModel",
        dict(
            patch_size=1,
            in_channels=16,  # 4 VAE latent channels, packed 2x2
            num_layers=2,
            num_single_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,  # two stacked text-encoder layers of width 16
            timestep_guidance_channels=32,
            mlp_ratio=2.0,
            axes_dims_rope=(2, 2, 2, 2),
        ),
    ),
    "longcat-image": (
        "LongCatImageTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=64,  # the pipeline's fixed 16 latent channels, packed 2x2
            num_layers=2,
            num_single_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            pooled_projection_dim=16,
            axes_dims_rope=[2, 2, 4],
        ),
    ),
    "joyimage-edit": (
        "JoyImageEditTransformer3DModel",
        dict(
            patch_size=[1, 2, 2],
            in_channels=4,
            hidden_size=16,
            num_attention_heads=2,
            text_dim=16,
            mlp_width_ratio=2.0,
            num_layers=3,
            rope_dim_list=[2, 2, 4],
            theta=256,
        ),
    ),
    "ovis-image": (
        "OvisImageTransformer2DModel",
        dict(
            patch_size=1,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            num_single_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            axes_dims_rope=(2, 2, 4),
        ),
    ),
    "qwen-image": (
        "QwenImageTransformer2DModel",
        dict(
            patch_size=2,
            in_channels=16,
            out_channels=4,
            num_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=16,
            guidance_embeds=False,
            axes_dims_rope=(2, 2, 4),
        ),
    ),
    "sd3": (
        "SD3Transformer2DModel",
        dict(
            sample_size=16,
            patch_size=1,
            in_channels=4,
            num_layers=3,
            attention_head_dim=8,
            num_attention_heads=2,
            joint_attention_dim=32,  # T5 width; the two CLIP widths (16 + 16) are zero-padded to it
            caption_projection_dim=16,
            pooled_projection_dim=32,  # the two CLIP projections, concatenated
            out_channels=4,
            pos_embed_max_size=16,
        ),
    ),
    "sdxl-unet": (
        "UNet2DConditionModel",
        dict(
            sample_size=16,
            in_channels=4,
            out_channels=4,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
            block_out_channels=(8, 16),
            layers_per_block=2,
            norm_num_groups=4,
            attention_head_dim=(2, 4),
            transformer_layers_per_block=(1, 2),
            use_linear_projection=True,
            cross_attention_dim=32,  # the two CLIP encoders' hidden states, concatenated (16 + 16)
            addition_embed_type="text_time",
            addition_time_embed_dim=8,
            projection_class_embeddings_input_dim=6 * 8 + 16,  # six time ids and the pooled CLIP-2 projection
        ),
    ),
    "wan-t2v": ("WanTransformer3DModel", _WAN),
    "wan-i2v": (
        "WanTransformer3DModel",
        dict(
            _WAN,
            in_channels=12,  # noise latents + 4 frame-mask channels + image latents
            image_dim=8,  # CLIP image features, as in Wan 2.1 I2V: adds the image embedder and added K/V
            added_kv_proj_dim=16,
        ),
    ),
    "cosmos3-omni": (
        "Cosmos3OmniTransformer",
        dict(
            head_dim=8,
            hidden_size=16,
            intermediate_size=32,
            latent_channel=4,
            latent_patch_size=1,
            patch_latent_dim=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            num_hidden_layers=3,
            rope_axes_dim=[2, 1, 1],  # head_dim / 2 rotary frequencies over (time, height, width)
            vocab_size=1536,  # covers the tiny Qwen2 tokenizer of .tokenizers
            enable_fps_modulation=False,
        ),
    ),
}


def build_dit(name: str, **overrides: Any) -> torch.nn.Module:
    """Construct the tiny model ``name`` with the current RNG (callers seed it); ``overrides`` edit its config."""
    import diffusers

    cls_name, config = CONFIGS[name]
    return finish(getattr(diffusers, cls_name)(**{**config, **overrides}))
