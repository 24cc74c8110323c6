"""Supported-table pipelines in the shapes of diffusers' fast tests: one-block DiTs and a one-layer encoder.

Real checkpoints have many blocks, but fine-tunes, distilled and pruned variants, small encoders and
adapters do not always: these are the cases where a library is tempted to refuse. FLUX.2 here has one
double- and one single-stream block and a Mistral3 encoder with one text and one vision layer;
Cosmos3-Omni and JoyImage-Edit have a DiT of one block, which streams through one slot.
"""

from __future__ import annotations

from dataclasses import replace

from offload_core.tiny.zoo import PipelineSpec, TinyPipeline, _cosmos3_omni, _flux2, _joyimage_edit


def _flux2_small(seed: int) -> TinyPipeline:
    return replace(_flux2(seed, text_layers=1, num_layers=1, num_single_layers=1), name="flux2-one-layer-encoder")


def _cosmos3_one_block(seed: int) -> TinyPipeline:
    return replace(_cosmos3_omni(seed, num_hidden_layers=1), name="cosmos3-omni-one-block")


def _joyimage_one_block(seed: int) -> TinyPipeline:
    return replace(_joyimage_edit(seed, num_layers=1), name="joyimage-edit-one-block")


SPECS: dict[str, PipelineSpec] = {
    "flux2-one-layer-encoder": PipelineSpec(
        "Flux2Pipeline", "FLUX.2 with one block per list and a one-layer Mistral3 encoder", ("transformer",),
        _flux2_small,
    ),
    "cosmos3-omni-one-block": PipelineSpec(
        "Cosmos3OmniPipeline", "Cosmos3-Omni with a one-block transformer", ("transformer",), _cosmos3_one_block
    ),
    "joyimage-edit-one-block": PipelineSpec(
        "JoyImageEditPipeline", "JoyImage-Edit with a one-block DiT; the Qwen3-VL vision tower runs", ("transformer",),
        _joyimage_one_block,
    ),
}
