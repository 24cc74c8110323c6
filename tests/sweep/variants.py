"""Supported-table pipelines in the shapes of diffusers' fast tests: one-block DiTs and a one-layer encoder.

Real checkpoints have many blocks, but fine-tunes, distilled and pruned variants, small encoders and
adapters do not always: these are the cases where a library is tempted to refuse. FLUX.2 here has one
double- and one single-stream block and a Mistral3 encoder with one text and one vision layer;
Cosmos3-Omni and JoyImage-Edit have a DiT of one block, which streams through one slot.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Callable

from offload_core.tiny.zoo import PipelineSpec, TinyPipeline, _cosmos3_omni, _flux2, _joyimage_edit

#: key -> the pipeline class, what it is, the supported table's builder and the shape it is built in here
VARIANTS: dict[str, tuple[str, str, Callable[..., TinyPipeline], dict[str, Any]]] = {
    "flux2-one-layer-encoder": (
        "Flux2Pipeline", "FLUX.2 with one block per list and a one-layer Mistral3 encoder",
        _flux2, dict(text_layers=1, num_layers=1, num_single_layers=1),
    ),
    "cosmos3-omni-one-block": (
        "Cosmos3OmniPipeline", "Cosmos3-Omni with a one-block transformer", _cosmos3_omni, dict(num_hidden_layers=1)
    ),
    "joyimage-edit-one-block": (
        "JoyImageEditPipeline", "JoyImage-Edit with a one-block DiT; the Qwen3-VL vision tower runs",
        _joyimage_edit, dict(num_layers=1),
    ),
}


def _variant(key: str, seed: int) -> TinyPipeline:
    _, _, build, shape = VARIANTS[key]
    return replace(build(seed, **shape), name=key)


SPECS: dict[str, PipelineSpec] = {
    key: PipelineSpec(cls_name, description, ("transformer",), partial(_variant, key))
    for key, (cls_name, description, _, _) in VARIANTS.items()
}
