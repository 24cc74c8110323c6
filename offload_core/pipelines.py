"""diffusers pipeline integration."""

from __future__ import annotations

from typing import Any


def is_pipeline(target: Any) -> bool:
    try:
        from diffusers import DiffusionPipeline
    except ImportError:  # pragma: no cover - diffusers is a dependency
        return False
    return isinstance(target, DiffusionPipeline)
