"""What enable logs about blocks: a model in which no blocks are found streams nothing, and that
is a warning (shown by default) naming the ``blocks=`` option; the INFO line about the blocks'
tensors kept resident lists the shared ones, never the rest of the model's own."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import offload_core

pytestmark = pytest.mark.quick


class Flat(nn.Module):
    """Weights, but no list of repeated blocks for discovery to find."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.layers = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))

    def forward(self, x):
        return self.layers(self.stem(x))


class Tied(nn.Module):
    """Three blocks, the first and the last sharing a weight, between a stem and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.head = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.blocks[2].weight = self.blocks[0].weight

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def enabled(caplog, model: nn.Module, level: int, **options):
    """(handle, the offload_core records at ``level`` or above, the output of one forward, the
    output without offload)."""
    x = torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    caplog.clear()
    with caplog.at_level(level, logger="offload_core"):
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend="fake", **options)
    records = [r for r in caplog.records if r.levelno >= level]
    with torch.no_grad():
        out = model(x.to(handle.backend.device())).cpu()
    return handle, records, out, expected


def test_no_blocks_found_is_a_warning_naming_blocks_and_blocks_makes_it_stream(caplog):
    torch.manual_seed(0)
    model = Flat()
    handle, records, out, expected = enabled(caplog, model, logging.WARNING)
    try:
        warned = [r for r in records if "Flat has no blocks to stream" in r.message]
        assert len(warned) == 1 and warned[0].levelno == logging.WARNING
        assert "nothing is offloaded" in warned[0].message and "blocks= option" in warned[0].message
        assert torch.equal(out, expected) and handle.stats()["loads"] == 0  # nothing streamed
    finally:
        handle.disable()
    handle, records, out, expected = enabled(caplog, model, logging.WARNING, blocks=["layers"])
    try:
        assert not [r for r in records if "no blocks to stream" in r.message]
        assert torch.equal(out, expected) and handle.stats()["loads"] > 0
    finally:
        handle.disable()


def test_only_the_blocks_shared_tensors_are_listed(caplog):
    torch.manual_seed(0)
    handle, records, out, expected = enabled(caplog, Tied(), logging.INFO, blocks=["blocks"])
    try:
        lines = [r.message for r in records if "stay resident, not streamed" in r.message]
        assert len(lines) == 1 and lines[0].startswith("1 tensors of the blocks")  # not the stem's and head's 4
        assert torch.equal(out, expected)
    finally:
        handle.disable()
