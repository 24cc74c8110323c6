"""The supported-model table (docs/models.md) as block registrations.

Names were read from each diffusers 0.42 class; where the upstream table names a list the class
does not have, the class's real lists are registered (noted per row). Architectures diffusers
does not ship are registered by bare class name, so any implementation with that class name and
topology is recognised.
"""

from __future__ import annotations

from .blocks import register_blocks

#: class key -> block attributes, in execution order
KNOWN_MODELS: dict[str, tuple[str, ...]] = {
    "Flux2Transformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "LongCatImageTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "JoyImageEditTransformer3DModel": ("double_blocks",),
    # upstream names a list `transformer`; the diffusers class has these two
    "OvisImageTransformer2DModel": ("transformer_blocks", "single_transformer_blocks"),
    "QwenImageTransformer2DModel": ("transformer_blocks",),
    "SD3Transformer2DModel": ("transformer_blocks",),
    # SDXL's UNet; mid_block is streamed too, in execution order
    "UNet2DConditionModel": ("down_blocks", "mid_block", "up_blocks"),
    "SDXLUNet2DConditionModel": ("down_blocks", "mid_block", "up_blocks"),
    "WanTransformer3DModel": ("blocks",),
    # upstream splits Cosmos3 into a VFM transformer and a language model; diffusers has one class
    "Cosmos3OmniTransformer": ("layers",),
    "Cosmos3VFMTransformer": ("layers",),
    "Cosmos3LanguageModel": ("layers", "gen_layers"),
    "NextStepModel": ("layers",),
    "Qwen2MoTModel": ("layers",),
    # beyond the table (the pipeline sweep): classes whose lists run in another order than they are declared
    "Lumina2Transformer2DModel": ("context_refiner", "noise_refiner", "layers"),
}

for _name, _attrs in KNOWN_MODELS.items():
    register_blocks(_name, _attrs)
