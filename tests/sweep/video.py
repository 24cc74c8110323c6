"""Video pipelines of the sweep: CogVideoX, HunyuanVideo, LTX-Video (text- and image-to-video), Allegro,
Mochi, Latte and SkyReels-V2.

Each has its own 3D VAE, shrunk to 8 or 32 channels a level (Mochi's decoder needs 32); videos have a few
frames of 16 or 32 pixels. DiTs have one or two blocks per list, as in diffusers' fast tests.
"""

from __future__ import annotations

from typing import Any

from offload_core.tiny import encoders as enc
from offload_core.tiny import tokenizers as tok
from offload_core.tiny import vaes as vae
from offload_core.tiny.spec import PipelineSpec, TinyPipeline, _call, _finish, _reference_image, _seeded_components


def _video_call(size: int, frames: int, **settings: Any) -> dict[str, Any]:
    return _call(size, num_frames=frames, max_sequence_length=16, **settings)


def _flow(**config: Any):
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**config)


def _cogvideox(seed: int) -> TinyPipeline:
    from diffusers import AutoencoderKLCogVideoX, CogVideoXDDIMScheduler, CogVideoXPipeline
    from diffusers import CogVideoXTransformer3DModel

    tokenizer = tok.t5_tokenizer()

    def transformer():
        return enc.finish(
            CogVideoXTransformer3DModel(
                num_attention_heads=2,
                attention_head_dim=8,  # heads x head dim a multiple of 16: the 3D sin-cos embedding
                in_channels=4,
                out_channels=4,
                time_embed_dim=2,
                text_embed_dim=32,  # the T5 width
                num_layers=1,
                sample_width=2,
                sample_height=2,
                sample_frames=9,
                patch_size=2,
                temporal_compression_ratio=4,
                max_text_seq_length=16,
            )
        )

    def vae():
        return enc.finish(
            AutoencoderKLCogVideoX(
                down_block_types=("CogVideoXDownBlock3D",) * 4,
                up_block_types=("CogVideoXUpBlock3D",) * 4,
                block_out_channels=(8, 8, 8, 8),
                latent_channels=4,
                layers_per_block=1,
                norm_num_groups=2,
                temporal_compression_ratio=4,
            )
        )

    components = _seeded_components(
        seed, text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=32), vae=vae, transformer=transformer
    )
    pipe = CogVideoXPipeline(scheduler=CogVideoXDDIMScheduler(), tokenizer=tokenizer, **components)
    return _finish("cogvideox", pipe, _video_call(16, 8, guidance_scale=1.0), "frames")


def _hunyuan_video(seed: int) -> TinyPipeline:
    from diffusers import AutoencoderKLHunyuanVideo, HunyuanVideoPipeline, HunyuanVideoTransformer3DModel

    llama_tok, clip = tok.llama_tokenizer(), tok.clip_tokenizer()

    def transformer():
        return enc.finish(
            HunyuanVideoTransformer3DModel(
                in_channels=4,
                out_channels=4,
                num_attention_heads=2,
                attention_head_dim=10,
                num_layers=1,
                num_single_layers=1,
                num_refiner_layers=1,
                patch_size=1,
                patch_size_t=1,
                guidance_embeds=True,
                text_embed_dim=16,  # the Llama width
                pooled_projection_dim=8,  # the CLIP width
                rope_axes_dim=(2, 4, 4),
            )
        )

    def vae():
        return enc.finish(
            AutoencoderKLHunyuanVideo(
                latent_channels=4,
                down_block_types=("HunyuanVideoDownBlock3D",) * 4,
                up_block_types=("HunyuanVideoUpBlock3D",) * 4,
                block_out_channels=(8, 8, 8, 8),
                layers_per_block=1,
                norm_num_groups=4,
                scaling_factor=0.476986,
                spatial_compression_ratio=8,
                temporal_compression_ratio=4,
            )
        )

    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.llama(llama_tok, hidden_size=16),
        text_encoder_2=lambda: enc.clip_text(clip, hidden_size=8, projection_dim=8),
        vae=vae,
        transformer=transformer,
    )
    pipe = HunyuanVideoPipeline(scheduler=_flow(shift=7.0), tokenizer=llama_tok, tokenizer_2=clip, **components)
    # The released prompt template is long; the tiny run uses the bare prompt.
    call = _video_call(16, 5, guidance_scale=4.5, prompt_template={"template": "{}", "crop_start": 0})
    return _finish("hunyuan-video", pipe, call, "frames")


def _ltx_vae():
    from diffusers import AutoencoderKLLTXVideo

    vae = AutoencoderKLLTXVideo(
        latent_channels=8,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, False, False),
        decoder_spatio_temporal_scaling=(True, True, False, False),
        decoder_inject_noise=(False, False, False, False, False),
        upsample_residual=(False, False, False, False),
        upsample_factor=(1, 1, 1, 1),
        timestep_conditioning=False,
        patch_size=1,
        patch_size_t=1,
        encoder_causal=True,
        decoder_causal=False,
    )
    vae.use_framewise_encoding = False
    vae.use_framewise_decoding = False
    return enc.finish(vae)


def _ltx_components(seed: int) -> dict[str, Any]:
    from diffusers import LTXVideoTransformer3DModel

    tokenizer = tok.t5_tokenizer()

    def transformer():
        return enc.finish(
            LTXVideoTransformer3DModel(
                in_channels=8,
                out_channels=8,
                patch_size=1,
                patch_size_t=1,
                num_attention_heads=2,
                attention_head_dim=8,
                cross_attention_dim=16,
                num_layers=2,
                caption_channels=32,  # the T5 width
            )
        )

    return {
        "tokenizer": tokenizer,
        **_seeded_components(
            seed, text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=32), vae=_ltx_vae, transformer=transformer
        ),
    }


def _ltx(seed: int) -> TinyPipeline:
    from diffusers import LTXPipeline

    pipe = LTXPipeline(scheduler=_flow(), **_ltx_components(seed))
    return _finish("ltx", pipe, _video_call(32, 9, guidance_scale=1.0), "frames")


def _ltx_i2v(seed: int) -> TinyPipeline:
    from diffusers import LTXImageToVideoPipeline

    pipe = LTXImageToVideoPipeline(scheduler=_flow(), **_ltx_components(seed))
    return _finish("ltx-i2v", pipe, _video_call(32, 9, guidance_scale=1.0, image=_reference_image(32)), "frames")


def _allegro(seed: int) -> TinyPipeline:
    from diffusers import AllegroPipeline, AllegroTransformer3DModel, AutoencoderKLAllegro, DDIMScheduler

    tokenizer = tok.t5_tokenizer()

    def transformer():
        return enc.finish(
            AllegroTransformer3DModel(
                num_attention_heads=2,
                attention_head_dim=12,  # a multiple of 3: rotary frequencies over (time, height, width)
                in_channels=4,
                out_channels=4,
                num_layers=1,
                cross_attention_dim=24,
                sample_width=8,
                sample_height=8,
                sample_frames=8,
                caption_channels=24,  # the T5 width
            )
        )

    def vae():
        model = AutoencoderKLAllegro(
            down_block_types=("AllegroDownBlock3D",) * 4,
            up_block_types=("AllegroUpBlock3D",) * 4,
            block_out_channels=(8, 8, 8, 8),
            latent_channels=4,
            layers_per_block=1,
            norm_num_groups=2,
            temporal_compression_ratio=4,
        )
        model.enable_tiling()  # Allegro's VAE decodes only in tiles
        return enc.finish(model)

    components = _seeded_components(
        seed, text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=24), vae=vae, transformer=transformer
    )
    pipe = AllegroPipeline(scheduler=DDIMScheduler(), tokenizer=tokenizer, **components)
    call = _video_call(16, 8, guidance_scale=1.0, clean_caption=False)
    return _finish("allegro", pipe, call, "frames")


def _mochi(seed: int) -> TinyPipeline:
    from diffusers import AutoencoderKLMochi, MochiPipeline, MochiTransformer3DModel

    tokenizer = tok.t5_tokenizer()

    def transformer():
        model = MochiTransformer3DModel(
            patch_size=2,
            num_attention_heads=2,
            attention_head_dim=8,
            num_layers=2,
            pooled_projection_dim=16,
            in_channels=12,
            qk_norm="rms_norm",
            text_embed_dim=32,  # the T5 width
            time_embed_dim=4,
            activation_fn="swiglu",
            max_sequence_length=16,
        )
        model.pos_frequencies.data.zero_()  # allocated with torch.empty: fixed so that two builds agree
        return enc.finish(model)

    def vae():
        return enc.finish(
            AutoencoderKLMochi(
                latent_channels=12,
                out_channels=3,
                encoder_block_out_channels=(32, 32, 32, 32),
                decoder_block_out_channels=(32, 32, 32, 32),
                layers_per_block=(1, 1, 1, 1, 1),
            )
        )

    components = _seeded_components(
        seed, text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=32), vae=vae, transformer=transformer
    )
    pipe = MochiPipeline(scheduler=_flow(), tokenizer=tokenizer, **components)
    return _finish("mochi", pipe, _video_call(16, 7, guidance_scale=1.0), "frames")


def _latte(seed: int) -> TinyPipeline:
    from diffusers import DDIMScheduler, LattePipeline, LatteTransformer3DModel

    tokenizer = tok.t5_tokenizer()

    def transformer():
        # Latte alternates spatial and temporal blocks: two lists, run interleaved.
        return enc.finish(
            LatteTransformer3DModel(
                sample_size=8,
                num_layers=1,
                patch_size=2,
                attention_head_dim=8,
                num_attention_heads=2,
                caption_channels=32,  # the T5 width
                in_channels=4,
                cross_attention_dim=16,
                out_channels=8,
                attention_bias=True,
                activation_fn="gelu-approximate",
                num_embeds_ada_norm=1000,
                norm_type="ada_norm_single",
                norm_elementwise_affine=False,
                norm_eps=1e-6,
                video_length=2,
            )
        )

    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=32),
        vae=lambda: vae.autoencoder_kl(latent_channels=4),
        transformer=transformer,
    )
    pipe = LattePipeline(scheduler=DDIMScheduler(), tokenizer=tokenizer, **components)
    call = _call(16, video_length=2, guidance_scale=1.0, clean_caption=False)
    return _finish("latte", pipe, call, "frames")


def _tolerate_missing_ftfy(module) -> None:
    """Let a pipeline module's prompt cleaning run without the optional ``ftfy`` package.

    Like Wan's image-to-video module (see :func:`..pipelines._tolerate_missing_ftfy`), SkyReels-V2's
    calls ``ftfy.fix_text`` although it imports ``ftfy`` only when installed; for the zoo's ASCII prompts
    ``fix_text`` is the identity, which is installed in that module only, and only when ``ftfy`` is missing.
    """
    import types

    if not hasattr(module, "ftfy"):
        module.ftfy = types.SimpleNamespace(fix_text=lambda text: text)


def _skyreels_v2(seed: int) -> TinyPipeline:
    from diffusers import SkyReelsV2Pipeline, SkyReelsV2Transformer3DModel, UniPCMultistepScheduler
    from diffusers.pipelines.skyreels_v2 import pipeline_skyreels_v2

    _tolerate_missing_ftfy(pipeline_skyreels_v2)

    tokenizer = tok.t5_tokenizer()

    def transformer():
        return enc.finish(
            SkyReelsV2Transformer3DModel(
                patch_size=(1, 2, 2),
                num_attention_heads=2,
                attention_head_dim=8,
                in_channels=4,
                out_channels=4,
                text_dim=16,  # the UMT5 width
                freq_dim=16,
                ffn_dim=32,
                num_layers=2,
                cross_attn_norm=True,
                qk_norm="rms_norm_across_heads",
                rope_max_seq_len=32,
            )
        )

    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.umt5_encoder(tokenizer, d_model=16),
        vae=lambda: vae.autoencoder_kl_wan(z_dim=4),
        transformer=transformer,
    )
    scheduler = UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction")
    pipe = SkyReelsV2Pipeline(scheduler=scheduler, tokenizer=tokenizer, **components)
    return _finish("skyreels-v2", pipe, _video_call(16, 5, guidance_scale=1.0), "frames")


SPECS: dict[str, PipelineSpec] = {
    "cogvideox": PipelineSpec(
        "CogVideoXPipeline", "CogVideoX text-to-video: a one-block expert DiT, T5, 3D VAE", ("transformer",),
        _cogvideox,
    ),
    "hunyuan-video": PipelineSpec(
        "HunyuanVideoPipeline", "HunyuanVideo: double and single blocks and a token refiner; Llama and CLIP",
        ("transformer",), _hunyuan_video,
    ),
    "ltx": PipelineSpec("LTXPipeline", "LTX-Video text-to-video; T5", ("transformer",), _ltx),
    "ltx-i2v": PipelineSpec(
        "LTXImageToVideoPipeline", "LTX-Video image-to-video: the first frame conditions", ("transformer",), _ltx_i2v
    ),
    "allegro": PipelineSpec(
        "AllegroPipeline", "Allegro text-to-video: one block, tiled 3D VAE; T5", ("transformer",), _allegro
    ),
    "mochi": PipelineSpec("MochiPipeline", "Mochi 1: asymmetric DiT; T5", ("transformer",), _mochi),
    "latte": PipelineSpec(
        "LattePipeline", "Latte: spatial and temporal blocks interleaved; T5", ("transformer",), _latte
    ),
    "skyreels-v2": PipelineSpec(
        "SkyReelsV2Pipeline", "SkyReels-V2 text-to-video (Wan layout); UMT5", ("transformer",), _skyreels_v2
    ),
}
