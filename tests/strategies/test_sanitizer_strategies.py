"""The strategies under the race sanitizer: removing a slot-free wait (write-after-read, the class
of bug chaos mode cannot see) is reported with both lines, the copy's and the compute's."""

from __future__ import annotations

import re

import pytest
import torch

import offload_core
from offload_core_fake import StreamRaceError

from helpers import chaos_backend
from stacks import StackSpec, build_stack

X = torch.randn(2, 8, generator=torch.Generator().manual_seed(0))


class _Unordered:
    """An event whose record and wait order nothing: the wait on it, removed."""

    def record(self, stream=None) -> None: ...

    def wait(self, stream=None) -> None: ...

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


def _stack():
    return build_stack(StackSpec(d=8, layer_dtypes=[[torch.float32], [torch.float32, torch.float32]] * 2))


def _assert_names_both_lines(report: str, copy_line: str) -> None:
    assert report.startswith("write-after-read race on fake device memory"), report
    assert re.search(r"this access: +write by copy_async \(H2D\) on stream 'stream-\d+'", report), report
    assert re.search(copy_line, report), report
    assert re.search(r"earlier access: +read by aten\.\w+\.\w+ on stream 'default'", report), report
    assert re.search(r"at tests/stacks\.py:\d+ in forward", report), report  # the compute that read it


def test_layerwise_without_the_slot_free_wait_is_a_reported_race():
    model = _stack()
    with torch.no_grad():
        expected = model(X)
    handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=chaos_backend())
    with torch.no_grad():
        assert torch.equal(model(X), expected)  # correct as shipped
    part = handle.parts[0]
    part.ring._freed = [_Unordered() for _ in part.ring._freed]  # the ring's free events, made unordered
    with pytest.raises(StreamRaceError) as race, torch.no_grad():
        model(X)
    report = str(race.value)
    _assert_names_both_lines(report, r"at offload_core/strategies/transport\.py:\d+ in issue")
    assert re.search(r"in slot \d of layerwise Stack \(block blocks\.\d\)", report), report
    handle.disable()


def test_model_level_without_the_free_wait_is_a_reported_race():
    """A group's new device buffers may reuse the memory of the group swapped out before it, which
    compute may still be reading: its copies must wait for that compute."""
    model = _stack()
    with torch.no_grad():
        expected = model(X)
    handle = offload_core.enable_offload(model, enable_cpu_offload=True, backend=chaos_backend())
    with torch.no_grad():
        for _ in range(2):
            assert torch.equal(model(X), expected)  # correct as shipped
    part = handle.parts[0]
    part._freed = _Unordered
    with pytest.raises(StreamRaceError) as race, torch.no_grad():
        model(X)
    report = str(race.value)
    _assert_names_both_lines(report, r"at offload_core/strategies/model_level\.py:\d+ in _queue_load")
    assert "Stack on the device (Stack group)" in report
    handle.disable()


@pytest.mark.parametrize("target", ["stack", "pipeline"])
def test_a_second_enable_on_one_backend_fills_its_buffers_after_the_first_runs_compute(target):
    """The slots and resident copies of a second enable may reuse the memory the first one's
    compute was reading a moment ago: their copies must be ordered after that compute."""
    backend = chaos_backend()
    if target == "stack":
        model = _stack()
        with torch.no_grad():
            expected = model(X)
        run = lambda: model(X)  # noqa: E731
    else:
        from offload_core.tiny import build_pipeline

        tiny = build_pipeline("flux2")
        model, expected = tiny.pipe, tiny.run(seed=0)
        run = lambda: tiny.run(seed=0)  # noqa: E731
    for _ in range(2):
        handle = offload_core.enable_offload(model, enable_layerwise_offload=True, backend=backend)
        with torch.no_grad():
            assert torch.equal(run(), expected)
        handle.disable()


def test_resident_modules_fill_their_buffers_after_earlier_compute():
    """Resident components of a pipeline are copied in once, into buffers that may reuse memory
    compute read just before: the same ordering, for the part that has no host sync before it."""
    from offload_core.common.transaction import Transaction
    from offload_core.strategies.resident import ResidentModules

    backend = chaos_backend()
    model = _stack()
    with torch.no_grad():
        expected = model(X)
    for _ in range(2):
        part = ResidentModules([("stack", model)], backend)
        with Transaction() as txn:
            part.enable(txn)
        with torch.no_grad():
            assert torch.equal(model(X), expected)
        part.disable()
