"""Image DiT pipelines of the sweep: PixArt-alpha and -Sigma, Sana, AuraFlow, Lumina 2, HiDream-I1,
CogView3-Plus and CogView4, HunyuanDiT, DiT (class-conditional) and Z-Image.

Between them they bring the text encoders the other families do not: Gemma 2 (Sana, Lumina 2), Llama
(HiDream), GLM (CogView4), BERT (HunyuanDiT), Qwen3 (Z-Image), and four encoders in one pipeline
(HiDream). DiTs with one block per list stream through one slot.
"""

from __future__ import annotations

from typing import Any

from offload_core.tiny import encoders as enc
from offload_core.tiny import tokenizers as tok
from offload_core.tiny import vaes as vae
from offload_core.tiny.spec import PipelineSpec, TinyPipeline, _call, _finish, _seeded_components


def _vae(latent_channels: int = 4):
    return vae.autoencoder_kl(latent_channels=latent_channels, shift_factor=0.06, scaling_factor=1.5)


def _flow():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler()


def _pixart_dit():
    from diffusers import PixArtTransformer2DModel

    return enc.finish(
        PixArtTransformer2DModel(
            sample_size=8,
            num_layers=2,
            patch_size=2,
            attention_head_dim=8,
            num_attention_heads=2,
            caption_channels=32,  # the T5 width
            in_channels=4,
            cross_attention_dim=16,
            out_channels=8,  # mean and variance
            attention_bias=True,
            activation_fn="gelu-approximate",
            num_embeds_ada_norm=1000,
            norm_type="ada_norm_single",
            norm_elementwise_affine=False,
            norm_eps=1e-6,
        )
    )


def _pixart(cls_name: str, key: str) -> Any:
    def build(seed: int) -> TinyPipeline:
        import diffusers
        from diffusers import DDIMScheduler

        tokenizer = tok.t5_tokenizer()
        components = _seeded_components(
            seed, text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=32), vae=_vae, transformer=_pixart_dit
        )
        pipe = getattr(diffusers, cls_name)(scheduler=DDIMScheduler(), tokenizer=tokenizer, **components)
        call = _call(16, guidance_scale=1.0, use_resolution_binning=False, max_sequence_length=16, clean_caption=False)
        return _finish(key, pipe, call, "images")

    return build


def _sana(seed: int) -> TinyPipeline:
    from diffusers import AutoencoderDC, FlowMatchEulerDiscreteScheduler, SanaPipeline, SanaTransformer2DModel

    tokenizer = tok.gemma_tokenizer()

    def transformer():
        return enc.finish(
            SanaTransformer2DModel(
                patch_size=1,
                in_channels=4,
                out_channels=4,
                num_layers=1,
                num_attention_heads=2,
                attention_head_dim=4,
                num_cross_attention_heads=2,
                cross_attention_head_dim=4,
                cross_attention_dim=8,
                caption_channels=16,  # the Gemma width
                sample_size=16,
            )
        )

    def vae():
        # The deep-compression autoencoder: a ResBlock level and an EfficientViT (linear attention) level.
        return enc.finish(
            AutoencoderDC(
                in_channels=3,
                latent_channels=4,
                attention_head_dim=2,
                encoder_block_types=("ResBlock", "EfficientViTBlock"),
                decoder_block_types=("ResBlock", "EfficientViTBlock"),
                encoder_block_out_channels=(8, 8),
                decoder_block_out_channels=(8, 8),
                encoder_qkv_multiscales=((), (5,)),
                decoder_qkv_multiscales=((), (5,)),
                encoder_layers_per_block=(1, 1),
                decoder_layers_per_block=(1, 1),
                downsample_block_type="conv",
                upsample_block_type="interpolate",
                decoder_norm_types="rms_norm",
                decoder_act_fns="silu",
                scaling_factor=0.41407,
            )
        )

    components = _seeded_components(
        seed, text_encoder=lambda: enc.gemma2(tokenizer, hidden_size=16), vae=vae, transformer=transformer
    )
    pipe = SanaPipeline(scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0), tokenizer=tokenizer, **components)
    call = _call(
        32, guidance_scale=1.0, use_resolution_binning=False, max_sequence_length=16, complex_human_instruction=None
    )
    return _finish("sana", pipe, call, "images")


def _auraflow(seed: int) -> TinyPipeline:
    from diffusers import AuraFlowPipeline, AuraFlowTransformer2DModel

    tokenizer = tok.t5_tokenizer()

    def transformer():
        return enc.finish(
            AuraFlowTransformer2DModel(
                sample_size=8,
                patch_size=2,
                in_channels=4,
                num_mmdit_layers=1,
                num_single_dit_layers=1,
                attention_head_dim=8,
                num_attention_heads=2,
                caption_projection_dim=16,
                joint_attention_dim=16,  # the UMT5 width
                out_channels=4,
                pos_embed_max_size=64,
            )
        )

    components = _seeded_components(
        seed, text_encoder=lambda: enc.umt5_encoder(tokenizer, d_model=16), vae=_vae, transformer=transformer
    )
    pipe = AuraFlowPipeline(scheduler=_flow(), tokenizer=tokenizer, **components)
    return _finish("auraflow", pipe, _call(16, guidance_scale=1.0, max_sequence_length=16), "images")


def _lumina2(seed: int) -> TinyPipeline:
    from diffusers import Lumina2Pipeline, Lumina2Transformer2DModel

    tokenizer = tok.gemma_tokenizer()

    def transformer():
        return enc.finish(
            Lumina2Transformer2DModel(
                sample_size=8,
                patch_size=2,
                in_channels=4,
                hidden_size=16,
                num_layers=2,
                num_refiner_layers=1,
                num_attention_heads=2,
                num_kv_heads=1,
                multiple_of=16,
                norm_eps=1e-5,
                axes_dim_rope=(4, 2, 2),
                cap_feat_dim=16,  # the Gemma width
            )
        )

    components = _seeded_components(
        seed, text_encoder=lambda: enc.gemma2(tokenizer, hidden_size=16), vae=_vae, transformer=transformer
    )
    pipe = Lumina2Pipeline(scheduler=_flow(), tokenizer=tokenizer, **components)
    # Lumina 2 puts a system prompt before the prompt: a short one keeps the prompt within the tiny length.
    # Its latent size assumes a VAE factor of 8: 32 pixels are 4 x 4 latents here.
    call = _call(32, guidance_scale=1.0, max_sequence_length=32, system_prompt="You are a helpful assistant.")
    return _finish("lumina2", pipe, call, "images")


def _hidream(seed: int) -> TinyPipeline:
    from diffusers import HiDreamImagePipeline, HiDreamImageTransformer2DModel

    clip, clip_2, t5, llama_tok = tok.clip_tokenizer(), tok.clip_tokenizer(), tok.t5_tokenizer(), tok.llama_tokenizer()

    def transformer():
        # A mixture-of-experts DiT that reads the hidden states of chosen Llama layers in every block.
        return enc.finish(
            HiDreamImageTransformer2DModel(
                patch_size=2,
                in_channels=4,
                out_channels=4,
                num_layers=1,
                num_single_layers=1,
                attention_head_dim=8,
                num_attention_heads=2,
                caption_channels=[32, 16],  # the T5 width, the Llama width
                text_emb_dim=32,  # the two CLIP projections, concatenated
                num_routed_experts=4,
                num_activated_experts=2,
                axes_dims_rope=(4, 2, 2),
                max_resolution=(16, 16),
                llama_layers=(0, 1),
            )
        )

    components = {
        **_seeded_components(
            seed, text_encoder=lambda: enc.clip_text_with_projection(clip, hidden_size=16, projection_dim=16)
        ),
        **_seeded_components(
            seed + 1, text_encoder_2=lambda: enc.clip_text_with_projection(clip_2, hidden_size=16, projection_dim=16)
        ),
        **_seeded_components(
            seed,
            text_encoder_3=lambda: enc.t5_encoder(t5, d_model=32),
            text_encoder_4=lambda: enc.llama(llama_tok, hidden_size=16, causal_lm=True),
            vae=_vae,
            transformer=transformer,
        ),
    }
    pipe = HiDreamImagePipeline(
        scheduler=_flow(), tokenizer=clip, tokenizer_2=clip_2, tokenizer_3=t5, tokenizer_4=llama_tok, **components
    )
    # HiDream rescales every request to the area of its default size (128 latents a side): 8 keeps it tiny.
    pipe.default_sample_size = 8
    return _finish("hidream", pipe, _call(16, guidance_scale=1.0, max_sequence_length=16), "images")


def _cogview3(seed: int) -> TinyPipeline:
    from diffusers import CogVideoXDDIMScheduler, CogView3PlusPipeline, CogView3PlusTransformer2DModel

    tokenizer = tok.t5_tokenizer()

    def transformer():
        return enc.finish(
            CogView3PlusTransformer2DModel(
                patch_size=2,
                in_channels=4,
                num_layers=1,
                attention_head_dim=4,
                num_attention_heads=2,
                out_channels=4,
                text_embed_dim=32,  # the T5 width
                time_embed_dim=8,
                condition_dim=2,
                pos_embed_max_size=8,
                sample_size=8,
            )
        )

    components = _seeded_components(
        seed, text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=32), vae=_vae, transformer=transformer
    )
    pipe = CogView3PlusPipeline(scheduler=CogVideoXDDIMScheduler(), tokenizer=tokenizer, **components)
    return _finish("cogview3", pipe, _call(16, guidance_scale=1.0, max_sequence_length=16), "images")


def _cogview4(seed: int) -> TinyPipeline:
    from diffusers import CogView4Pipeline, CogView4Transformer2DModel, FlowMatchEulerDiscreteScheduler

    tokenizer = tok.byte_level_tokenizer()

    def transformer():
        return enc.finish(
            CogView4Transformer2DModel(
                patch_size=2,
                in_channels=4,
                num_layers=2,
                attention_head_dim=4,
                num_attention_heads=2,
                out_channels=4,
                text_embed_dim=16,  # the GLM width
                time_embed_dim=8,
                condition_dim=4,
            )
        )

    components = _seeded_components(
        seed, text_encoder=lambda: enc.glm(tokenizer, hidden_size=16), vae=_vae, transformer=transformer
    )
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True, time_shift_type="linear"
    )
    pipe = CogView4Pipeline(scheduler=scheduler, tokenizer=tokenizer, **components)
    return _finish("cogview4", pipe, _call(16, guidance_scale=1.0, max_sequence_length=16), "images")


def _hunyuan_dit(seed: int) -> TinyPipeline:
    from diffusers import DDPMScheduler, HunyuanDiT2DModel, HunyuanDiTPipeline

    bert_tok, t5 = tok.bert_tokenizer(), tok.t5_tokenizer()

    def transformer():
        return enc.finish(
            HunyuanDiT2DModel(
                sample_size=8,
                num_layers=2,
                patch_size=2,
                attention_head_dim=8,
                num_attention_heads=2,
                in_channels=4,
                cross_attention_dim=16,  # the BERT width
                cross_attention_dim_t5=32,  # the T5 width
                pooled_projection_dim=16,
                hidden_size=16,
                activation_fn="gelu-approximate",
            )
        )

    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.bert(bert_tok, hidden_size=16),
        text_encoder_2=lambda: enc.t5_encoder(t5, d_model=32),
        vae=_vae,
        transformer=transformer,
    )
    pipe = HunyuanDiTPipeline(
        scheduler=DDPMScheduler(),
        tokenizer=bert_tok,
        tokenizer_2=t5,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
        **components,
    )
    call = _call(16, guidance_scale=1.0, use_resolution_binning=False)
    return _finish("hunyuan-dit", pipe, call, "images")


def _dit(seed: int) -> TinyPipeline:
    from diffusers import DDIMScheduler, DiTPipeline, DiTTransformer2DModel

    def transformer():
        return enc.finish(
            DiTTransformer2DModel(
                sample_size=8,
                num_layers=2,
                patch_size=4,
                attention_head_dim=8,
                num_attention_heads=2,
                in_channels=4,
                out_channels=8,
                attention_bias=True,
                activation_fn="gelu-approximate",
                num_embeds_ada_norm=1000,
                norm_type="ada_norm_zero",
                norm_elementwise_affine=False,
            )
        )

    pipe = DiTPipeline(scheduler=DDIMScheduler(), **_seeded_components(seed, vae=_vae, transformer=transformer))
    call = {"class_labels": [1], "num_inference_steps": 2, "guidance_scale": 1.0, "output_type": "pt"}
    return _finish("dit", pipe, call, "images")


def _z_image(seed: int) -> TinyPipeline:
    import torch
    from diffusers import ZImagePipeline, ZImageTransformer2DModel

    tokenizer = tok.qwen2_tokenizer()

    def transformer():
        model = ZImageTransformer2DModel(
            all_patch_size=(2,),
            all_f_patch_size=(1,),
            in_channels=4,
            dim=16,
            n_layers=2,
            n_refiner_layers=1,
            n_heads=2,
            n_kv_heads=2,
            norm_eps=1e-5,
            qk_norm=True,
            cap_feat_dim=16,  # the Qwen3 width
            rope_theta=256.0,
            t_scale=1000.0,
            axes_dims=[4, 2, 2],
            axes_lens=[64, 16, 16],
        )
        with torch.no_grad():  # allocated with torch.empty: fixed so that two builds agree
            model.x_pad_token.fill_(1.0)
            model.cap_pad_token.fill_(1.0)
        return enc.finish(model)

    components = _seeded_components(
        seed, text_encoder=lambda: enc.qwen3(tokenizer, hidden_size=16), vae=_vae, transformer=transformer
    )
    pipe = ZImagePipeline(scheduler=_flow(), tokenizer=tokenizer, **components)
    return _finish("z-image", pipe, _call(16, guidance_scale=1.0, max_sequence_length=16), "images")


SPECS: dict[str, PipelineSpec] = {
    "pixart-alpha": PipelineSpec(
        "PixArtAlphaPipeline", "PixArt-alpha: adaLN-single DiT, T5", ("transformer",),
        _pixart("PixArtAlphaPipeline", "pixart-alpha"),
    ),
    "pixart-sigma": PipelineSpec(
        "PixArtSigmaPipeline", "PixArt-Sigma: PixArt-alpha's DiT, longer T5 prompts", ("transformer",),
        _pixart("PixArtSigmaPipeline", "pixart-sigma"),
    ),
    "sana": PipelineSpec(
        "SanaPipeline", "Sana: a one-block linear-attention DiT, Gemma 2, deep-compression VAE", ("transformer",),
        _sana,
    ),
    "auraflow": PipelineSpec(
        "AuraFlowPipeline", "AuraFlow: one MMDiT and one single DiT block, UMT5", ("transformer",), _auraflow
    ),
    "lumina2": PipelineSpec(
        "Lumina2Pipeline", "Lumina-Image 2.0: refiner and main layers, Gemma 2", ("transformer",), _lumina2
    ),
    "hidream": PipelineSpec(
        "HiDreamImagePipeline", "HiDream-I1: mixture-of-experts DiT; two CLIPs, T5 and Llama", ("transformer",),
        _hidream,
    ),
    "cogview3": PipelineSpec(
        "CogView3PlusPipeline", "CogView3-Plus: a one-block DiT, T5", ("transformer",), _cogview3
    ),
    "cogview4": PipelineSpec("CogView4Pipeline", "CogView4: DiT, GLM text encoder", ("transformer",), _cogview4),
    "hunyuan-dit": PipelineSpec(
        "HunyuanDiTPipeline", "HunyuanDiT: DiT with skip connections; BERT and T5", ("transformer",), _hunyuan_dit
    ),
    "dit": PipelineSpec("DiTPipeline", "DiT: class-conditional, no text encoder", ("transformer",), _dit),
    "z-image": PipelineSpec(
        "ZImagePipeline", "Z-Image: single-stream DiT with refiners, Qwen3", ("transformer",), _z_image
    ),
}
