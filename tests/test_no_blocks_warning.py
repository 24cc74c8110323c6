"""Layerwise offload of a model in which no blocks are found streams nothing: that is a warning
(shown by default), naming the ``blocks=`` option, and naming the lists makes it stream."""

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


def test_no_blocks_found_is_a_warning_naming_blocks_and_blocks_makes_it_stream(caplog):
    torch.manual_seed(0)
    model, x = Flat(), torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
    with caplog.at_level(logging.WARNING, logger="offload_core"):
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend="fake")
    try:
        warned = [r for r in caplog.records
                  if r.levelno == logging.WARNING and "Flat has no blocks to stream" in r.message]
        assert len(warned) == 1 and "nothing is offloaded" in warned[0].message
        assert "blocks= option" in warned[0].message
        with torch.no_grad():
            assert torch.equal(model(x.to(handle.backend.device())).cpu(), expected)
        assert handle.stats()["loads"] == 0  # nothing streamed
    finally:
        handle.disable()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="offload_core"):
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend="fake",
                                             blocks=["layers"])
    try:
        assert not [r for r in caplog.records if "no blocks to stream" in r.message]
        with torch.no_grad():
            out = model(x.to(handle.backend.device()))
        assert torch.equal(out.cpu(), expected) and handle.stats()["loads"] > 0
    finally:
        handle.disable()
