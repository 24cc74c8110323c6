"""Tiny diffusers denoisers (DiTs and the SDXL UNet) on their own, with inputs for one forward pass.

Layerwise offloading streams a model's *block lists* (``nn.ModuleList`` attributes) and keeps everything else
resident, so every entry of :data:`TRANSFORMERS` records which attributes of the diffusers 0.42.1 class hold
its blocks. These names were read from the class definitions, not from the upstream table: diffusers names the
lists differently in places (Ovis-Image has ``transformer_blocks`` and ``single_transformer_blocks``, not
``transformer``; JoyImage has ``double_blocks``; Cosmos3's one model keeps its decoder layers in ``layers``).

The models are those of the tiny pipelines (:func:`offload_core.tiny.transformers.build_dit`, same configs);
``model(**inputs)`` runs in eval mode in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from offload_core.tiny.encoders import seeded
from offload_core.tiny.transformers import CONFIGS, build_dit


@dataclass(frozen=True)
class TinySpec:
    """A tiny model of the zoo: its class name, its block lists, and how to build it with inputs."""

    cls_name: str
    block_attrs: tuple[str, ...]
    description: str
    build: Callable[[int], tuple[torch.nn.Module, dict[str, Any]]] = field(repr=False, compare=False)


def _noise(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _input_generator(seed: int) -> torch.Generator:
    """Inputs come from their own CPU generator, independent of the one the weights were drawn from."""
    return torch.Generator("cpu").manual_seed(10_000 + seed)


# --------------------------------------------------------------------------------------------------------------
# Inputs for one forward pass
# --------------------------------------------------------------------------------------------------------------


def _grid_ids(height: int, width: int, axes: int, first: float = 0.0, offset: int = 0) -> torch.Tensor:
    """Image-token position ids: (first, row + offset, col + offset[, 0]) per token, row-major."""
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    ids = [torch.full_like(rows, first, dtype=torch.float32), rows + offset, cols + offset]
    ids += [torch.zeros_like(rows)] * (axes - 3)
    return torch.stack([i.float() for i in ids], dim=-1).reshape(height * width, axes)


def _text_ids(length: int, axes: int) -> torch.Tensor:
    """Text-token position ids: Flux2 numbers text on its last (fourth) axis, the 3-axis models on both
    spatial axes (as LongCat-Image's and Ovis-Image's pipelines do)."""
    ids = torch.zeros(length, axes)
    positions = torch.arange(length, dtype=torch.float32)
    if axes == 4:
        ids[:, 3] = positions
    else:
        ids[:, 1] = ids[:, 2] = positions
    return ids


# The packed-token DiTs (Flux2, LongCat-Image, Ovis-Image, Qwen-Image) see a _GRID x _GRID image of tokens and
# _TEXT_LEN text tokens; their position ids, image shapes and text masks must agree with these lengths.
_GRID = 4
_TEXT_LEN = 8


def _image_and_text_tokens(model, g) -> dict[str, torch.Tensor]:
    """Noise for the packed image tokens and the text tokens of a packed-token DiT, drawn in that order."""
    c = model.config
    return {
        "hidden_states": _noise(g, 1, _GRID * _GRID, c.in_channels),
        "encoder_hidden_states": _noise(g, 1, _TEXT_LEN, c.joint_attention_dim),
    }


def _inputs_flux2(model, g) -> dict[str, Any]:
    return {
        **_image_and_text_tokens(model, g),
        "timestep": torch.tensor([0.5]),
        "img_ids": _grid_ids(_GRID, _GRID, 4).unsqueeze(0),
        "txt_ids": _text_ids(_TEXT_LEN, 4).unsqueeze(0),
        "guidance": torch.tensor([4.0]),
        "return_dict": False,
    }


def _inputs_flux_like(model, g) -> dict[str, Any]:
    """LongCat-Image and Ovis-Image: Flux.1-style joint + single stream blocks with 3-axis ids."""
    return {
        **_image_and_text_tokens(model, g),
        "timestep": torch.tensor([0.5]),
        "img_ids": _grid_ids(_GRID, _GRID, 3, first=1.0, offset=_TEXT_LEN),  # after the text positions
        "txt_ids": _text_ids(_TEXT_LEN, 3),
        "return_dict": False,
    }


def _inputs_joyimage(model, g) -> dict[str, Any]:
    c = model.config
    # (batch, items, channels, frames, height, width): the edit target and the reference image.
    return {
        "hidden_states": _noise(g, 1, 2, c.in_channels, 1, 4, 4),
        "timestep": torch.tensor([500.0]),
        "encoder_hidden_states": _noise(g, 1, 8, c.text_dim),
        "return_dict": False,
    }


def _inputs_qwen_image(model, g) -> dict[str, Any]:
    return {
        **_image_and_text_tokens(model, g),
        "encoder_hidden_states_mask": torch.ones(1, _TEXT_LEN, dtype=torch.long),
        "timestep": torch.tensor([0.5]),
        "img_shapes": [[(1, _GRID, _GRID)]],
        "return_dict": False,
    }


def _inputs_sd3(model, g) -> dict[str, Any]:
    c = model.config
    return {
        "hidden_states": _noise(g, 1, c.in_channels, 8, 8),
        "encoder_hidden_states": _noise(g, 1, 8, c.joint_attention_dim),
        "pooled_projections": _noise(g, 1, c.pooled_projection_dim),
        "timestep": torch.tensor([500.0]),
        "return_dict": False,
    }


def _inputs_sdxl_unet(model, g) -> dict[str, Any]:
    c = model.config
    text_embeds_dim = c.projection_class_embeddings_input_dim - 6 * c.addition_time_embed_dim
    return {
        "sample": _noise(g, 1, c.in_channels, 8, 8),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _noise(g, 1, 8, c.cross_attention_dim),
        "added_cond_kwargs": {
            "text_embeds": _noise(g, 1, text_embeds_dim),
            "time_ids": torch.tensor([[16.0, 16.0, 0.0, 0.0, 16.0, 16.0]]),
        },
        "return_dict": False,
    }


def _inputs_wan(model, g) -> dict[str, Any]:
    c = model.config
    inputs = {
        "hidden_states": _noise(g, 1, c.in_channels, 2, 4, 4),
        "timestep": torch.tensor([500]),
        "encoder_hidden_states": _noise(g, 1, 8, c.text_dim),
        "return_dict": False,
    }
    if c.image_dim is not None:
        inputs["encoder_hidden_states_image"] = _noise(g, 1, 4, c.image_dim)
    return inputs


def _inputs_cosmos3(model, g) -> dict[str, Any]:
    """Cosmos3's forward takes a packed text + vision sequence (ids, positions, index maps, per-token timesteps).

    Rather than re-implementing the packing, one denoising step of the real pipeline is run around ``model``
    and the keyword arguments of its transformer call are kept.
    """
    from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

    from offload_core.tiny.vaes import autoencoder_kl_wan
    from offload_core.tiny.tokenizers import qwen2_tokenizer

    tokenizer = qwen2_tokenizer()
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError("the tiny Cosmos3 model's vocabulary is smaller than the tiny tokenizer's")
    with seeded(0):  # only its config matters here: the step's output stays latent
        vae = autoencoder_kl_wan(z_dim=model.config.latent_channel)
    pipe = Cosmos3OmniPipeline(
        transformer=model,
        text_tokenizer=tokenizer,
        vae=vae,
        scheduler=UniPCMultistepScheduler(),
        enable_safety_checker=False,
    )
    pipe.set_progress_bar_config(disable=True)
    captured: dict[str, Any] = {}

    def keep_first_call(_module, _args, kwargs):
        if not captured:
            captured.update(_cloned(kwargs))

    handle = model.register_forward_pre_hook(keep_first_call, with_kwargs=True)
    try:
        pipe(
            prompt="a cat sitting on a bench",
            height=32,
            width=32,
            num_frames=1,
            num_inference_steps=1,
            guidance_scale=1.0,
            enable_safety_check=False,
            output_type="latent",
            generator=g,
        )
    finally:
        handle.remove()
    return captured


def _cloned(obj: Any) -> Any:
    """A copy of a (nested) argument structure whose tensors no later in-place update can reach."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _cloned(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cloned(v) for v in obj)
    return obj


_BLOCKS_FLUX = ("transformer_blocks", "single_transformer_blocks")

_SPECS: list[tuple[str, tuple[str, ...], str, Callable]] = [
    ("flux2", _BLOCKS_FLUX, "FLUX.2 DiT: double-stream then single-stream blocks", _inputs_flux2),
    ("longcat-image", _BLOCKS_FLUX, "LongCat-Image DiT (Flux.1 layout)", _inputs_flux_like),
    ("joyimage-edit", ("double_blocks",), "JoyImage-Edit 3D DiT, double-stream blocks only", _inputs_joyimage),
    ("ovis-image", _BLOCKS_FLUX, "Ovis-Image DiT (Flux.1 layout)", _inputs_flux_like),
    ("qwen-image", ("transformer_blocks",), "Qwen-Image MMDiT", _inputs_qwen_image),
    ("sd3", ("transformer_blocks",), "SD3 MMDiT", _inputs_sd3),
    ("sdxl-unet", ("down_blocks", "up_blocks"), "SDXL-like UNet (text_time added conditioning)", _inputs_sdxl_unet),
    ("wan-t2v", ("blocks",), "Wan text-to-video DiT", _inputs_wan),
    ("wan-i2v", ("blocks",), "Wan image-to-video DiT with a CLIP image embedder (image_dim)", _inputs_wan),
    ("cosmos3-omni", ("layers",), "Cosmos3 omni mixture-of-transformers decoder", _inputs_cosmos3),
]


def _builder(name: str, make_inputs: Callable) -> Callable[[int], tuple[torch.nn.Module, dict[str, Any]]]:
    def build(seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
        with seeded(seed):
            model = build_dit(name)
        with torch.no_grad():
            inputs = make_inputs(model, _input_generator(seed))
        return model, inputs

    build.__name__ = f"build_{name.replace('-', '_')}"
    return build


TRANSFORMERS: dict[str, TinySpec] = {
    name: TinySpec(CONFIGS[name][0], attrs, description, _builder(name, make_inputs))
    for name, attrs, description, make_inputs in _SPECS
}


def build_transformer(name: str, seed: int = 0) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Build the tiny denoiser ``name`` (a key of :data:`TRANSFORMERS`) and inputs for ``model(**inputs)``."""
    try:
        spec = TRANSFORMERS[name]
    except KeyError:
        raise KeyError(f"unknown tiny transformer {name!r}; known: {', '.join(TRANSFORMERS)}") from None
    return spec.build(seed)
