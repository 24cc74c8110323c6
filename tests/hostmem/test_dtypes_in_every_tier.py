"""Every dtype a buffer can have (complex, float8, unsigned, bool, ...) works in every host tier:
pinned, pageable, staged through the bounce ring, spilled to disk, and read from a checkpoint
(into RAM, or left on disk), with outputs ``torch.equal`` to the model without offload. A rotary
table of dtype complex64 in a disk-tier block raised ``KeyError: torch.complex64``."""

from __future__ import annotations

import warnings

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import offload_core
from offload_core.hostmem.disk import read_index
from offload_core.hostmem.safetensors_header import DTYPES
from offload_core.weights.checkpoint import attach_slices

from helpers import chaos_backend

pytestmark = pytest.mark.fake_only


def _buffer_dtypes() -> list[torch.dtype]:
    """Every dtype of this torch whose tensors can be made, copied and seen as bytes: what a
    buffer can hold."""
    found = set()
    for dtype in vars(torch).values():
        if isinstance(dtype, torch.dtype):
            try:
                with warnings.catch_warnings():  # complex32 is "experimental", quantized ones deprecated
                    warnings.simplefilter("ignore")
                    torch.empty(4, dtype=dtype).copy_(torch.empty(4, dtype=dtype)).view(torch.uint8)
            except (RuntimeError, TypeError):
                continue
            found.add(dtype)
    return sorted(found, key=str)


DTYPES_OF_BUFFERS = _buffer_dtypes()


class Block(nn.Module):
    """A linear layer and one buffer of each dtype; the output depends on every byte of each."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        g = torch.Generator().manual_seed(i)
        for k, dtype in enumerate(DTYPES_OF_BUFFERS):
            raw = torch.randint(0, 256, (16 * dtype.itemsize,), dtype=torch.uint8, generator=g)
            # saved where a checkpoint can hold the dtype; the others are computed at construction
            self.register_buffer(f"b{k}", raw.view(dtype).clone(), persistent=dtype in DTYPES.values())
        self.register_buffer("rotary", torch.polar(torch.ones(8), torch.arange(8.0) * (i + 1)), persistent=False)

    def forward(self, x):
        weights = torch.arange(1, 17, dtype=torch.float64, device=x.device)
        total = sum((getattr(self, f"b{k}").view(torch.uint8).to(torch.float64).reshape(-1, 16) * weights).sum()
                    for k in range(len(DTYPES_OF_BUFFERS)))
        return (self.linear(x) * self.rotary).real + total.to(torch.float32) / 1e6


def model() -> nn.Module:
    torch.manual_seed(0)
    m = nn.Module()
    m.blocks = nn.ModuleList(Block(i) for i in range(3))
    m.forward = lambda x: [x := b(x) for b in m.blocks][-1]
    return m.eval()


X = torch.randn(2, 8)

TIERS = {
    "pinned": {},
    "pageable": {"pin_memory": False},
    "staged": {"pinned_memory": 0},
    "spilled": {"host_memory": 0, "offload_folder": True},
}


def test_the_buffers_cover_complex_float8_unsigned_and_bool():
    assert {torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.uint32, torch.bool} <= set(DTYPES_OF_BUFFERS)


@pytest.mark.parametrize("tier", TIERS)
def test_every_dtype_works_in_each_tier_of_a_model_in_memory(tier, tmp_path):
    m = model()
    with torch.no_grad():
        expected = m(X)
    options = {k: (tmp_path if v is True else v) for k, v in TIERS[tier].items()}
    handle = offload_core.enable_offload(m, enable_layerwise_offload=True, backend=chaos_backend(), blocks=["blocks"],
                                         **options)
    try:
        if tier == "spilled":  # one file per block, which any safetensors reader takes
            assert handle.stats()["disk_bytes"] > 0
            files = sorted(tmp_path.rglob("*.safetensors"))
            assert len(files) == 3
            for path in files:
                with safe_open(str(path), framework="pt") as f:
                    assert sorted(f.metadata().values()) == sorted({str(b.dtype) for b in m.blocks[0].buffers()} |
                                                                   {"torch.float32"})
                    assert all(f.get_tensor(k).dtype == torch.uint8 for k in f.keys())
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(m(X.to(handle.backend.device())).cpu(), expected)
    finally:
        handle.disable()
    with torch.no_grad():
        assert torch.equal(m(X), expected)


@pytest.mark.parametrize("host_memory", [None, 0], ids=["read-into-ram", "left-on-disk"])
def test_every_dtype_a_checkpoint_holds_works_read_from_it(host_memory, tmp_path):
    """The checkpoint holds the weights and the buffers of safetensors' dtypes (complex64 as
    C64); the other buffers, and the complex rotary table, are computed at construction."""
    reference = model()
    with torch.no_grad():
        expected = reference(X)
    saved = reference.state_dict()
    assert any(v.dtype == torch.complex64 for v in saved.values())
    save_file(saved, str(tmp_path / "weights.safetensors"))
    m = model()  # the checkpoint's tensors attached as file slices, as from_pretrained attaches them
    attach_slices(m, read_index([tmp_path / "weights.safetensors"]), lambda key, t, source: t.dtype,
                  lambda t, dtype: t.requires_grad)
    assert all(t.is_meta for k, t in m.state_dict(keep_vars=True).items() if k in saved)
    handle = offload_core.enable_offload(m, enable_layerwise_offload=True, backend=chaos_backend(), blocks=["blocks"],
                                         host_memory=host_memory)
    try:
        assert (handle.stats()["disk_bytes"] > 0) == (host_memory == 0)
        for _ in range(2):
            with torch.no_grad():
                assert torch.equal(m(X.to(handle.backend.device())).cpu(), expected)
    finally:
        handle.disable()
