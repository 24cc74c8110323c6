"""The pipeline sweep: diffusers pipeline classes beyond the supported-model table, built tiny in code.

Each entry is a real diffusers pipeline class with every model shrunk (hidden sizes of 4 to 32, one
or two blocks per list, as in diffusers' own fast tests, whose dummy configs were the model here) and
tokenizers built in code, so that nothing is downloaded. ``tests/test_pipeline_sweep.py`` runs every
entry with model-level offload, layerwise offload and layerwise offload of every component group,
each ``torch.equal`` to the pipeline without offload; ``docs/models.md`` lists them.

A few entries are variants of supported-table pipelines in the shapes diffusers' fast tests use
(a one-block DiT, a one-layer text encoder): the cases that must stream or be staged, never refused.

Importing this package imports neither diffusers nor transformers; building a pipeline does.
"""

from __future__ import annotations

from offload_core.tiny.zoo import PipelineSpec, TinyPipeline
from . import audio, dits, flux, sd, video, variants

#: key -> spec, for every pipeline of the sweep
SWEEP: dict[str, PipelineSpec] = {
    **sd.SPECS,
    **flux.SPECS,
    **dits.SPECS,
    **video.SPECS,
    **audio.SPECS,
    **variants.SPECS,
}


def build_sweep_pipeline(name: str, seed: int = 0) -> TinyPipeline:
    """Build the sweep pipeline ``name`` (a key of :data:`SWEEP`) with weights drawn from ``seed``."""
    try:
        spec = SWEEP[name]
    except KeyError:
        raise KeyError(f"unknown sweep pipeline {name!r}; known: {', '.join(SWEEP)}") from None
    return spec.build(seed)


__all__ = ["SWEEP", "build_sweep_pipeline"]
