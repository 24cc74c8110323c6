"""Activation headroom estimated from a model's config and the shape of the call.

A block's forward holds, besides its weights, a few tensors of the sequence it transforms: the
hidden states in and out, the normalised copy, queries, keys and values, and the feed-forward
layer's wide intermediate and its activation. So its transient memory grows with the tokens of the
call (the latent grid of the image or video, plus the text it attends to) and with the block's
widths, which the block's own linear layers give: the hidden width (their most common input) and
the widest output (the feed-forward layer's). This module turns those into bytes:

    tokens x batch x element size x (4 x hidden + 2 x widest)

and, for a VAE's decoder, the full-resolution feature maps it writes (pixels x its first width x a
few copies). Attention scores are left out: accelerators run memory-efficient attention. It is an
estimate, stated as such in the plan, and the first call measures the real figure.
"""

from __future__ import annotations

import collections
import math
from typing import Any, Sequence

from torch import nn

from .components import CallShape

#: hidden-width and widest-output copies a block's forward holds at once (see the module docstring)
HIDDEN_COPIES, WIDE_COPIES = 4, 2
#: full-resolution feature maps a VAE decoder holds at once, and the frames it decodes together
DECODER_COPIES, DECODER_FRAMES = 8, 4


def _itemsize(module: nn.Module) -> int:
    for p in module.parameters():
        if p.is_floating_point():
            return p.element_size()
    return 4


def _widths(blocks: Sequence[nn.Module]) -> tuple[int, int] | None:
    """(hidden width, widest output) of the blocks' linear layers; None without any."""
    linears = [m for block in blocks for m in block.modules() if isinstance(m, nn.Linear)]
    if not linears:
        return None
    hidden = collections.Counter(m.in_features for m in linears).most_common(1)[0][0]
    return hidden, max(m.out_features for m in linears)


def _config(module: nn.Module) -> Any:
    return getattr(module, "config", None)


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    if isinstance(config, dict) or hasattr(config, "get"):
        return config.get(key, default)
    return getattr(config, key, default)


def latent_factors(vae: nn.Module | None) -> tuple[int, int] | None:
    """(spatial, temporal) compression of a pipeline's VAE from its config: Wan-style causal VAEs
    halve each side once per down level and time at ``temperal_downsample``; image VAEs once per
    level after the first, times their own patch size (FLUX.2's). None without a VAE."""
    config = _config(vae) if vae is not None else None
    if config is None:
        return None
    temporal = _get(config, "temperal_downsample")
    if temporal is not None:
        return 2 ** len(temporal), 2 ** sum(bool(t) for t in temporal)
    channels = _get(config, "block_out_channels")
    if channels is None:
        return None
    patch = _get(config, "patch_size") or 1
    patch = patch[0] if isinstance(patch, (list, tuple)) else patch
    return 2 ** (len(channels) - 1) * int(patch), int(_get(config, "temporal_compression_ratio", 1) or 1)


def _patch(config: Any) -> tuple[int, int, int]:
    patch = _get(config, "patch_size") or 1
    if isinstance(patch, int):
        return 1, patch, patch
    patch = tuple(int(p) for p in patch)
    return (1, *patch) if len(patch) == 2 else patch  # (time, height, width)


def block_tokens(dit: nn.Module, shape: CallShape, factors: tuple[int, int]) -> int:
    """The tokens one forward of a DiT transforms: its latent grid under the call's shape, and the
    text it attends to (jointly, or across: counted as if joint, the larger of the two)."""
    spatial, temporal = factors
    pt, ph, pw = _patch(_config(dit))
    frames = (shape.frames - 1) // temporal + 1 if temporal > 1 else shape.frames
    grid = math.ceil(frames / pt) * math.ceil(shape.height / spatial / ph) * math.ceil(shape.width / spatial / pw)
    return grid + shape.text_tokens


def estimate(kind: str, module: nn.Module, blocks: Sequence[nn.Module], shape: CallShape | None,
             factors: tuple[int, int] | None, batch: int = 1) -> int | None:
    """The activation headroom of one forward of ``module`` (a component of ``kind`` whose block
    stack is ``blocks``) in a call of ``shape``, with guidance batched into ``batch`` (None where
    the config or the shape does not say enough: the planner then falls back on its own estimate)."""
    if shape is None or shape.height is None or shape.width is None:
        return None
    itemsize = _itemsize(module)
    if kind == "vae":
        width = _get(_config(module), "block_out_channels", (None,))[0] or _get(_config(module), "base_dim")
        if not width:
            return None
        pixels = shape.height * shape.width * min(shape.frames, DECODER_FRAMES)
        return pixels * shape.batch * int(width) * itemsize * DECODER_COPIES
    widths = _widths(blocks)
    if widths is None:
        return None
    if kind == "dit":
        if factors is None:
            return None
        tokens, batch = block_tokens(module, shape, factors), shape.batch * batch
    elif kind == "text_encoder":
        tokens, batch = shape.text_tokens, shape.batch
    else:
        return None
    hidden, wide = widths
    return tokens * batch * itemsize * (HIDDEN_COPIES * hidden + WIDE_COPIES * wide)
