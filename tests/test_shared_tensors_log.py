"""The INFO line about tensors kept resident names the blocks' tensors that are shared, and
none of the rest of the model's own (which are resident anyway, nothing to report)."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import offload_core

pytestmark = pytest.mark.quick


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.blocks[2].weight = self.blocks[0].weight  # one tensor in two blocks

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_only_the_blocks_shared_tensors_are_listed(caplog):
    torch.manual_seed(0)
    model, x = Tied(), torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    with caplog.at_level(logging.INFO, logger="offload_core"):
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend="fake", blocks=["blocks"])
    try:
        lines = [r.message for r in caplog.records if "stay resident, not streamed" in r.message]
        assert len(lines) == 1 and lines[0].startswith("1 tensors of the blocks")
        with torch.no_grad():
            assert torch.equal(model(x.to(handle.backend.device())).cpu(), expected)
    finally:
        handle.disable()
