"""The stack whose blocks are each 0.6 of a power of two (one DxD float32 weight), the input it
runs on, and the units a handle packed: shared by the pinned-memory tests (slabs, registered
memory, the pageable fallback)."""

from __future__ import annotations

import torch
from torch import nn

from offload_core.weights import WeightUnit

D = 396  # a float32 DxD weight is 627 264 bytes: 0.598 of a power of two (1 MiB)


class Stack(nn.Module):
    """Blocks of one DxD float32 weight each, so every block is 0.6 of a power of two."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.blocks = nn.ModuleList(nn.Linear(D, D, bias=False) for _ in range(blocks))
        for block in self.blocks:
            block.weight.data = torch.randn(D, D, generator=g) / D**0.5
        self.norm = nn.LayerNorm(D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = torch.tanh(block(x))
        return self.norm(x)


X = torch.randn(2, D, generator=torch.Generator().manual_seed(1))


def packed_units(handle) -> list[WeightUnit]:
    part = handle.parts[0]
    if hasattr(part, "units"):
        return [part.resident, *part.units]
    return [c.unit for g in part.groups for c in g.components]

