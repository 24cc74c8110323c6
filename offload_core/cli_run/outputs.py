"""``offload-core run``'s files: the image or frames, the Chrome trace, the timeline picture.

A run writes all of its files or none: each is written under a temporary name in its final
directory, and all are renamed into place only once every one has been written, so a failure
(a full disk, an image that cannot be encoded) leaves no partial file and no file of a run that
did not finish. The paths were checked before the run (:func:`.arguments.check_writable`).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Callable, Sequence

import torch

#: (final path, function writing the file to the path it is given)
Writer = tuple[Path, Callable[[Path], None]]


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
        paths = [path.with_name(f"{path.stem}_{i:04d}{path.suffix}") for i in range(len(pixels))]
    return [(p, lambda to, image=image: Image.fromarray(image).save(to, format="PNG")) for p, image in zip(paths, pixels)]


def write_all(writers: Sequence[Writer]) -> list[Path]:
    """Run every writer into a temporary file beside its target, then rename them all into place;
    on any failure remove the temporary files and re-raise. Returns the final paths."""
    staged: list[tuple[Path, Path]] = []
    try:
        for final, write in writers:
            # a name of this process only (the targets are distinct), created with the usual mode
            temporary = final.with_name(f".{final.name}.{os.getpid()}.tmp")
            staged.append((temporary, final))
            write(temporary)
        for temporary, final in staged:
            os.replace(temporary, final)
    except BaseException:
        for temporary, _ in staged:
            with contextlib.suppress(OSError):
                temporary.unlink()
        raise
    return [final for _, final in staged]
