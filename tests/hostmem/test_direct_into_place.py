"""The disk tier reads a large tensor's whole pages straight into the bounce buffer where its
place there and its file offset lie alike within a page: the ring starts each home's first chunk
at the distance from a page that most of its large tensors' bytes lie from their file offsets (all
of a spill file's: it holds the home as laid out), and only the partial first and last pages of
such a tensor go through a reader's scratch buffer. Outputs stay exact."""

from __future__ import annotations

import pytest
import torch

import offload_core
from offload_core.hostmem import direct
from offload_core.weights.slices import ALIGN, DIRECT_MIN_BYTES, FileSlice

from helpers import chaos_backend, forward

pytestmark = pytest.mark.fake_only


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A Wan DiT of three blocks with float32 weights of 64 KiB and more, saved as diffusers
    saves one (a header padded to 8 bytes: tensors start anywhere within a page)."""
    from diffusers import WanTransformer3DModel
    from denoisers import build_transformer

    folder = tmp_path_factory.mktemp("wan-wide")
    small, inputs = build_transformer("wan-t2v")
    torch.manual_seed(0)
    wide = WanTransformer3DModel.from_config({**small.config, "attention_head_dim": 64, "ffn_dim": 256})
    wide.save_pretrained(folder)
    return folder, inputs


def through_scratch_at_most(units) -> tuple[int, int]:
    """(the most bytes a forward reading ``units`` from disk may copy from scratch buffers: a
    page at each end of a large slice lying as the ring lays its home out, all of any other; the
    bytes it reads)."""
    most = read = 0
    for unit in units:
        for dtype, segments in unit.image.segments.items():
            residue = unit.image.residue(dtype)
            for start, count, source in segments:
                if isinstance(source, FileSlice):
                    nbytes = count * source.dtype.itemsize
                    read += nbytes
                    alike = nbytes >= DIRECT_MIN_BYTES and (source.offset - start * dtype.itemsize) % ALIGN == residue
                    most += 2 * ALIGN if alike else nbytes
    return most, read


@pytest.mark.parametrize("home", ["checkpoint", "spill file"])
def test_large_tensors_on_disk_are_read_straight_into_the_bounce_buffers(checkpoint, home, tmp_path):
    from diffusers import WanTransformer3DModel

    folder, inputs = checkpoint

    def load(**budget):
        options = dict(enable_layerwise_offload=True, backend=chaos_backend(), **budget)
        if home == "checkpoint":
            return offload_core.from_pretrained(folder, **options)
        # weights in RAM: with a budget, the blocks are written to spill files
        return offload_core.enable_offload(WanTransformer3DModel.from_pretrained(folder), **options)

    in_ram = load()  # the same layout in RAM: the values a forward must give
    expected = forward(in_ram.target, inputs)
    in_ram.disable()
    handle = load(host_memory=0) if home == "checkpoint" else load(host_memory=0, offload_folder=tmp_path)
    units = [u for part in handle.parts for u in getattr(part, "units", ()) if u.image is not None]
    assert units
    if not direct.usable(units[0].image.extents()[0][0]):
        handle.disable()
        pytest.skip("this file system refuses O_DIRECT")
    most, per_forward = through_scratch_at_most(units)
    # a spill file lies as the home: all its large tensors' pages are read straight into place
    assert most < per_forward / (4 if home == "spill file" else 1)
    before, read_before = direct.scratch_bytes, handle.stats()["disk_read_bytes"]
    assert torch.equal(forward(handle.target, inputs), expected)
    assert handle.stats()["disk_read_bytes"] - read_before == per_forward
    assert 0 < direct.scratch_bytes - before <= most
    handle.disable()
