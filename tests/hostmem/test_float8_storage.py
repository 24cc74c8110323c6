"""``from_pretrained(..., storage_dtype=torch.float8_e4m3fn)`` on a bfloat16 checkpoint: each cast
weight is read from its slice straight into a float8 home (converted on the way, one tensor at a
time: no component is ever held in bfloat16), the output equals diffusers' own load with
``enable_layerwise_casting``; blocks on disk are read from the checkpoint and narrowed, or, with a
spill folder, spilled narrow and read narrow; ``stats()`` counts the bytes as stored."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.discovery import find_blocks
from offload_core.hostmem import disk

from helpers import chaos_backend, forward

pytestmark = pytest.mark.fake_only

FP8 = torch.float8_e4m3fn


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny FLUX.2 DiT of six blocks, eight heads wide, saved in bfloat16 as diffusers saves one,
    and the output of diffusers' load of it with float8 layerwise casting."""
    from diffusers import Flux2Transformer2DModel
    from denoisers import build_transformer

    folder = tmp_path_factory.mktemp("flux2-bf16")
    small, inputs = build_transformer("flux2")
    torch.manual_seed(0)
    config = {**small.config, "num_layers": 2, "num_single_layers": 4, "num_attention_heads": 8}
    Flux2Transformer2DModel.from_config(config).to(torch.bfloat16).save_pretrained(folder)
    inputs = {k: v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v for k, v in inputs.items()}
    reference = Flux2Transformer2DModel.from_pretrained(folder, dtype=torch.bfloat16)
    reference.enable_layerwise_casting(storage_dtype=FP8, compute_dtype=torch.bfloat16)
    return folder, inputs, forward(reference, inputs)


def block_regions(handle) -> tuple[int, int]:
    """(bytes as stored, bytes in the checkpoint) of the streamed blocks' regions."""
    units = handle.parts[0].units
    stored = sum(r.numel * r.dtype.itemsize for u in units for r in u.regions)
    return stored, sum(u.nbytes for u in units)


def test_weights_are_read_narrow_from_the_checkpoint_one_tensor_at_a_time(checkpoint, monkeypatch):
    folder, inputs, expected = checkpoint
    reads = []
    read = disk.FileSlice.read
    monkeypatch.setattr(disk.FileSlice, "read", lambda self, start, count, out: (
        reads.append((self.dtype, out.dtype, count, self.numel)), read(self, start, count, out))[1])
    handle = offload_core.from_pretrained(folder, torch_dtype=torch.bfloat16, storage_dtype=FP8,
                                          enable_layerwise_offload=True, backend=chaos_backend())
    narrowed = [r for r in reads if r[1] == FP8]
    assert narrowed and all(source == torch.bfloat16 and count <= numel for source, _, count, numel in narrowed)
    cast = [p for m in handle.target.modules() if "layerwise_casting" in getattr(getattr(m, "_diffusers_hook", None),
                                                                                "hooks", {}) for p in m.parameters()]
    assert sum(c for _, _, c, _ in narrowed) == sum(p.numel() for p in cast), "a cast weight was read wide"
    assert all(p.dtype == FP8 for p in cast)
    assert torch.equal(forward(handle.target, inputs), expected)
    stats = handle.stats()
    assert stats["host_bytes"] == handle.describe()[0]["host_bytes"] < sum(r[2] * 2 for r in reads)  # as stored
    handle.disable()
    assert torch.equal(forward(handle.target, inputs), expected), "after disable: diffusers' casting as it left it"


def test_blocks_on_disk_read_the_checkpoint_narrowing_it_or_a_narrow_spill(checkpoint, tmp_path):
    folder, inputs, expected = checkpoint
    for spill in (None, tmp_path / "spill"):
        options = {} if spill is None else {"offload_folder": spill}
        handle = offload_core.from_pretrained(folder, torch_dtype=torch.bfloat16, storage_dtype=FP8, host_memory=0,
                                              enable_layerwise_offload=True, backend=chaos_backend(), **options)
        stored, _ = block_regions(handle)
        wide = sum(p.numel() * 2 for _, block in find_blocks(handle.target) for p in block.parameters())
        if spill is not None:
            files = list(spill.glob("*/*.safetensors"))
            assert files and sum(f.stat().st_size for f in files) < 0.6 * wide, "the spill folder holds wide bytes"
        last = handle.stats()["disk_read_bytes"]
        for _ in range(2):
            assert torch.equal(forward(handle.target, inputs), expected), f"spill folder {spill}"
            now = handle.stats()["disk_read_bytes"]
            assert now - last == (wide if spill is None else stored), "bytes read per forward"
            last = now
        handle.disable()
