"""Conformance: ``copy_async`` moves bytes exactly, both ways, for every dtype and shape the
weight packer uses (including 0-d buffers and empty tensors)."""

from __future__ import annotations

import pytest
import torch

from offload_core.testing import kit

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.bool]
SHAPES = [(), (0,), (7,), (3, 5), (2, 0, 3), (4, 1, 16)]


def _shape_id(shape: tuple[int, ...]) -> str:
    return "x".join(map(str, shape)) or "0d"


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("shape", SHAPES, ids=_shape_id)
def test_round_trip_is_exact(backend, dtype, shape):
    """Host -> device -> host on a side stream gives back the same bits."""
    values = kit.sample(shape, dtype, seed=len(shape))
    src = kit.host(backend, values)
    dev = backend.empty_device(shape, dtype)
    out = backend.empty_pinned(shape, dtype)
    s = backend.new_stream()
    backend.copy_async(dev, src, s)
    backend.copy_async(out, dev, s)
    s.synchronize()
    assert dev.device.type == backend.device_type
    assert out.shape == values.shape and out.dtype == dtype
    assert torch.equal(out, values)


def test_large_copy_is_exact(backend):
    """A multi-megabyte copy (one packed weight unit) arrives whole."""
    values = kit.sample((1 << 20,), torch.float32, seed=7)
    dev = kit.upload(backend, values)
    assert torch.equal(kit.download(backend, dev), values)


def test_copy_into_views(backend):
    """Copies into and out of views at an offset of one buffer land where the view points
    (weight slots are carved out of one flat buffer per dtype)."""
    flat = backend.empty_device(64, torch.float32)
    parts = [kit.sample((16,), torch.float32, seed=i) for i in range(4)]
    srcs = [kit.host(backend, p) for p in parts]
    s = backend.new_stream()
    for i, src in enumerate(srcs):
        backend.copy_async(flat[16 * i : 16 * (i + 1)], src, s)
    out = backend.empty_pinned(16, torch.float32)
    backend.copy_async(out, flat[32:48], s)
    s.synchronize()
    assert torch.equal(out, parts[2])
    assert torch.equal(kit.download(backend, flat), torch.cat(parts))
