"""Audio pipelines of the sweep: Stable Audio Open (a DiT over the latents of the Oobleck autoencoder).

The text conditioning goes through a projection model that diffusers registers as its own component
(``projection_model``: neither a DiT, an encoder nor a VAE by name, so it stays resident), and the
output is a waveform, not an image.
"""

from __future__ import annotations

from offload_core.tiny import encoders as enc
from offload_core.tiny import tokenizers as tok
from offload_core.tiny.spec import PipelineSpec, TinyPipeline, _finish, _seeded_components


def _stable_audio(seed: int) -> TinyPipeline:
    from diffusers import (
        AutoencoderOobleck,
        EDMDPMSolverMultistepScheduler,
        StableAudioDiTModel,
        StableAudioPipeline,
        StableAudioProjectionModel,
    )

    tokenizer = tok.t5_tokenizer(model_max_length=16)

    def transformer():
        return enc.finish(
            StableAudioDiTModel(
                sample_size=4,
                in_channels=3,
                num_layers=2,
                attention_head_dim=4,
                num_key_value_attention_heads=2,
                out_channels=3,
                cross_attention_dim=4,
                time_proj_dim=8,
                global_states_input_dim=8,
                cross_attention_input_dim=4,
            )
        )

    def vae():
        return enc.finish(
            AutoencoderOobleck(
                encoder_hidden_size=6,
                downsampling_ratios=[1, 2],
                decoder_channels=3,
                decoder_input_channels=3,
                audio_channels=2,
                channel_multiples=[2, 4],
                sampling_rate=4,
            )
        )

    components = _seeded_components(
        seed,
        text_encoder=lambda: enc.t5_encoder(tokenizer, d_model=16),
        projection_model=lambda: enc.finish(
            StableAudioProjectionModel(text_encoder_dim=16, conditioning_dim=4, min_value=0, max_value=32)
        ),
        vae=vae,
        transformer=transformer,
    )
    # The released sampler (CosineDPMSolverMultistepScheduler) needs torchsde; this EDM solver takes its settings.
    scheduler = EDMDPMSolverMultistepScheduler(
        solver_order=2, prediction_type="v_prediction", sigma_data=1.0, sigma_schedule="exponential"
    )
    pipe = StableAudioPipeline(scheduler=scheduler, tokenizer=tokenizer, **components)
    call = {"prompt": "a cat sitting on a bench", "num_inference_steps": 2, "guidance_scale": 1.0,
            "audio_end_in_s": 2.0, "output_type": "pt"}
    return _finish("stable-audio", pipe, call, "audios")


SPECS: dict[str, PipelineSpec] = {
    "stable-audio": PipelineSpec(
        "StableAudioPipeline", "Stable Audio Open: audio DiT, T5 and a projection model, Oobleck VAE",
        ("transformer",), _stable_audio,
    ),
}
