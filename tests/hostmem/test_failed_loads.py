"""A load that fails is undone with its own error, and ``disable()`` always finishes.

A read of the checkpoint that fails while ``from_pretrained`` packs (a drive error, a file cut
short after it was checked) surfaces as itself: the undo used to mask it with
``NotImplementedError: aten::is_set_to`` (a parameter still on the meta device compared with its
home). Blocks on disk whose file can no longer be read (a forward failed on it) no longer make
every later ``disable()`` fail: their weights are left on the meta device, with an error logged
naming the file, and everything else comes back exact. The descriptors of the checkpoint close at
``disable()``, not at the next garbage collection."""

from __future__ import annotations

import errno
import gc
import logging
import os
import threading

import pytest
import torch

import offload_core
from offload_core import CheckpointError
from offload_core.base.errors import StagingError
from offload_core.weights import slices

from checkpoints import WEIGHTS, read_header, save, tiny_wan
from helpers import chaos_backend, forward

pytestmark = pytest.mark.fake_only


@pytest.fixture
def wan(tmp_path):
    model, inputs = tiny_wan(seed=0)
    save(model, tmp_path / "wan")
    return tmp_path / "wan", inputs, {k: v.clone() for k, v in model.state_dict().items()}, forward(model, inputs)


def load(folder, host_memory=None):
    return offload_core.from_pretrained(folder, enable_layerwise_offload=True, backend=chaos_backend(),
                                        host_memory=host_memory)


def descriptors_of(path) -> int:
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(str(path))
        except OSError:
            pass
    return count


@pytest.mark.parametrize("host_memory", [None, 0], ids=["ram", "disk"])
def test_a_read_that_fails_while_loading_surfaces_as_itself_and_leaves_nothing_behind(wan, host_memory, monkeypatch):
    folder, inputs, expected, output = wan
    reads, pread = [0], slices.pread_into

    def failing(fd, out, offset):
        reads[0] += 1
        if reads[0] == 6:  # some tensors are read and bound to their home already
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return pread(fd, out, offset)

    monkeypatch.setattr(slices, "pread_into", failing)
    with pytest.raises(OSError) as failed:
        load(folder, host_memory)
    assert failed.value.errno == errno.EIO  # not NotImplementedError from the undo
    assert not [t for t in threading.enumerate() if t.name in ("offload-core-stager", "offload-core-readahead")]
    assert descriptors_of(folder) == 0
    monkeypatch.setattr(slices, "pread_into", pread)
    handle = load(folder, host_memory)
    assert torch.equal(forward(handle.target, inputs), output)
    handle.disable()


def cut_inside_the_last_block(path) -> list[str]:
    """Cut the checkpoint short inside the last block's tensors (after it was checked); returns
    the names of the tensors it no longer holds whole."""
    header, data = read_header(path)
    start = os.path.getsize(path) - len(data)
    last = max(int(k.split(".")[1]) for k in header if k.startswith("blocks."))
    end = max(v["data_offsets"][1] for k, v in header.items() if k.startswith(f"blocks.{last}."))
    cut = end - 8
    os.truncate(path, start + cut)
    return [k for k, v in header.items() if k != "__metadata__" and v["data_offsets"][1] > cut]


def test_disable_finishes_after_a_forward_failed_on_an_unreadable_disk_block(wan, caplog):
    folder, inputs, expected, _ = wan
    handle = load(folder, host_memory=0)
    lost = cut_inside_the_last_block(folder / WEIGHTS)
    with pytest.raises(StagingError, match="short of a tensor"):
        forward(handle.target, inputs)
    model = handle.target
    with caplog.at_level(logging.ERROR, logger="offload_core.hostmem.placement"):
        handle.disable()
    assert not handle.enabled
    assert any(str(folder / WEIGHTS) in r.getMessage() and "meta device" in r.getMessage() for r in caplog.records)
    state = model.state_dict()
    lost_blocks = {k.split(".")[1] for k in lost if k.startswith("blocks.")}
    for key, value in expected.items():
        if key.startswith("blocks.") and key.split(".")[1] in lost_blocks:
            assert state[key].is_meta, key  # nothing to compute with: it fails loudly, never with wrong values
        else:
            assert torch.equal(state[key], value), key
    handle.disable()  # again: nothing left to do
    with pytest.raises(CheckpointError, match="past the end"):  # loading the damaged file again is refused
        load(folder, host_memory=0)


def test_disable_finishes_after_a_spill_file_was_removed(tmp_path, caplog):
    from torch import nn

    torch.manual_seed(0)
    model = nn.Module()
    model.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
    model.forward = lambda x: [x := b(x) for b in model.blocks][-1]
    handle = offload_core.enable_offload(model.eval(), enable_layerwise_offload=True, backend=chaos_backend(),
                                         blocks=["blocks"], host_memory=0, offload_folder=tmp_path)
    (victim,) = [os.path.join(d, f) for d, _, files in os.walk(tmp_path) for f in files if "blocks.2" in f]
    os.remove(victim)
    with pytest.raises(StagingError):
        with torch.no_grad():
            model(torch.randn(2, 8, device=handle.backend.device()))
    with caplog.at_level(logging.ERROR, logger="offload_core.hostmem.placement"):
        handle.disable()
    assert not handle.enabled and list(tmp_path.iterdir()) == []
    assert model.blocks[2].weight.is_meta and not model.blocks[1].weight.is_meta
    assert any(victim in r.getMessage() for r in caplog.records)


def test_disable_closes_the_checkpoints_descriptors_at_once(wan):
    folder, inputs, _, output = wan
    gc.disable()  # what is closed must be closed by disable itself, not by a collection
    try:
        handle = load(folder, host_memory=0)
        assert torch.equal(forward(handle.target, inputs), output)
        assert descriptors_of(folder) > 0  # the blocks were read from the checkpoint
        handle.disable()
        assert descriptors_of(folder) == 0
    finally:
        gc.enable()
