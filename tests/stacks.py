"""Small block stacks with the features an offloader must preserve: mixed dtypes, transposed
(non-contiguous) weights, non-persistent buffers, tied weights within a block, across blocks and
between a block and the resident head."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn


class Layer(nn.Module):
    def __init__(self, d: int, dtype: torch.dtype, transposed: bool, generator: torch.Generator) -> None:
        super().__init__()
        w = (torch.randn(d, d, generator=generator) * 0.3).to(dtype)
        self.weight = nn.Parameter(w.t() if transposed else w)
        self.register_buffer("scale", (torch.rand(d, generator=generator) + 0.5).to(dtype), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh((x.to(self.weight.dtype) @ self.weight) * self.scale).to(x.dtype)


class Block(nn.Module):
    def __init__(self, layers: list[Layer]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class Stack(nn.Module):
    def __init__(self, d: int, blocks: list[Block], generator: torch.Generator) -> None:
        super().__init__()
        self.embed = nn.Linear(d, d)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, d, bias=False)
        with torch.no_grad():
            self.embed.weight.copy_(torch.randn(d, d, generator=generator) * 0.3)
            self.embed.bias.copy_(torch.randn(d, generator=generator) * 0.1)
            self.head.weight.copy_(torch.randn(d, d, generator=generator) * 0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


@dataclasses.dataclass
class StackSpec:
    d: int = 8
    layer_dtypes: list[list[torch.dtype]] = dataclasses.field(default_factory=lambda: [[torch.float32]] * 3)
    transposed: bool = False
    tie_within: bool = False
    tie_across: bool = False
    tie_head: bool = False
    seed: int = 0


def build_stack(spec: StackSpec) -> Stack:
    g = torch.Generator().manual_seed(spec.seed)
    blocks = [Block([Layer(spec.d, dt, spec.transposed, g) for dt in dtypes]) for dtypes in spec.layer_dtypes]
    model = Stack(spec.d, blocks, g).eval()
    if spec.tie_within and len(blocks[0].layers) > 1 and blocks[0].layers[1].weight.dtype == blocks[0].layers[0].weight.dtype:
        blocks[0].layers[1].weight = blocks[0].layers[0].weight
    if spec.tie_across and len(blocks) > 2 and blocks[-1].layers[0].weight.dtype == blocks[1].layers[0].weight.dtype:
        blocks[-1].layers[0].weight = blocks[1].layers[0].weight
    if spec.tie_head and blocks[0].layers[0].weight.dtype == torch.float32:
        model.head.weight = blocks[0].layers[0].weight
    return model
