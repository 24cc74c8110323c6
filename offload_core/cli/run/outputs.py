"""``offload-core run``'s pixels as files: the output as frames, and one PNG writer per frame.

The command writes them together with the trace and the timeline picture through
:func:`~offload_core.cli.common.write_all`, all or none; the paths were checked before the run.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..common import Writer
from .arguments import frame_path


def frames_of(output: torch.Tensor) -> torch.Tensor:
    """The output as (N, C, H, W) frames: videos (B, F, C, H, W) flattened, channels-last moved."""
    x = output
    if x.dim() >= 3 and x.shape[-1] in (1, 3, 4) and x.shape[-3] not in (1, 3, 4):
        x = x.movedim(-1, -3)  # numpy / PIL layout (..., H, W, C)
    if x.dim() == 3:
        x = x.unsqueeze(0)
    if x.dim() < 3 or x.dim() > 5:
        raise ValueError(f"cannot read frames from an output of shape {tuple(output.shape)}")
    return x.reshape(-1, *x.shape[-3:])


def png_writers(output: torch.Tensor, path: Path) -> list[Writer]:
    """The output as PNG: one image to ``path``; several frames to ``<stem>_0000.png``, ..."""
    from PIL import Image

    frames = frames_of(output)
    if frames.dtype.is_floating_point:  # diffusers' "pt" / "np" outputs are in [0, 1]
        frames = (frames.float().clamp(0, 1) * 255).round()
    pixels = frames.to(torch.uint8).permute(0, 2, 3, 1).contiguous().numpy()  # N, H, W, C
    if pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    if len(pixels) == 1:
        paths = [path]
    else:
        paths = [frame_path(path, i) for i in range(len(pixels))]
    return [
        (p, lambda to, image=image: Image.fromarray(image).save(to, format="PNG")) for p, image in zip(paths, pixels)
    ]
