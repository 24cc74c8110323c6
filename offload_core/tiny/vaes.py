"""Tiny VAEs shared by the tiny pipelines: two- and three-level KL autoencoders and Wan's causal 3D VAE, built
like the encoders (float32, eval mode, under the caller's :func:`~.encoders.seeded`)."""

from __future__ import annotations

from .encoders import finish


def _two_level_kl(vae_cls: type, latent_channels: int, **extra):
    """``vae_cls`` (``AutoencoderKL`` or ``AutoencoderKLFlux2``, which take the same block layout) with two
    8-channel levels: a spatial factor of 2."""
    return finish(
        vae_cls(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D", "DownEncoderBlock2D"),
            up_block_types=("UpDecoderBlock2D", "UpDecoderBlock2D"),
            block_out_channels=(8, 8),
            layers_per_block=1,
            latent_channels=latent_channels,
            norm_num_groups=4,
            sample_size=16,
            **extra,
        )
    )


def autoencoder_kl(latent_channels: int = 4, **extra):
    """``AutoencoderKL`` with two 8-channel levels: a spatial factor of 2."""
    from diffusers import AutoencoderKL

    return _two_level_kl(AutoencoderKL, latent_channels, **extra)


def autoencoder_kl_flux2():
    """``AutoencoderKLFlux2`` (32 latent channels in the real model; 4 here), spatial factor 2."""
    from diffusers import AutoencoderKLFlux2

    return _two_level_kl(AutoencoderKLFlux2, 4, use_quant_conv=False, use_post_quant_conv=False)


def autoencoder_kl_wan(z_dim: int = 4, **extra):
    """``AutoencoderKLWan``: the causal 3D VAE of Wan (also used by JoyImage and Cosmos3), 8x spatial, 4x temporal."""
    from diffusers import AutoencoderKLWan

    return finish(
        AutoencoderKLWan(
            base_dim=4,
            z_dim=z_dim,
            dim_mult=[1, 1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True, True],
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
            **extra,
        )
    )


def autoencoder_kl_qwen_image(z_dim: int = 4):
    """``AutoencoderKLQwenImage``: 3 levels, so a spatial factor of 4."""
    from diffusers import AutoencoderKLQwenImage

    return finish(
        AutoencoderKLQwenImage(
            base_dim=8,
            z_dim=z_dim,
            dim_mult=[1, 1, 1],
            num_res_blocks=1,
            temperal_downsample=[False, True],
            latents_mean=[0.0] * z_dim,
            latents_std=[1.0] * z_dim,
        )
    )
