"""The Intel XPU backend ``xpu`` on a machine without an Intel GPU: registered like the CUDA and NPU
backends, probing initialises nothing, the collective library chosen by what torch has, the host
cache emptied by the name this torch has, and the accelerator base driving a stand-in ``torch.xpu``
(tests/xpu_standin.py) through the conformance kit and through the strategies, exactly."""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import offload_core
from offload_core import cli
from offload_core.device.accelerator import BackendUnavailableError
from offload_core.device.backend import Capability, DeviceBackend
from offload_core_xpu import XpuBackend

from plugin_dists import outcomes, plugin_env, write_installed
from vendor import Recorder, run_python, signature_problems, torch_as_of
from xpu_standin import StandInXpu, StandInXpuBackend

TESTS = Path(__file__).resolve().parents[1]
no_xpu_build = pytest.mark.skipif(torch.xpu._is_compiled(), reason="this torch build has XPU")
pytestmark = pytest.mark.quick


def test_registered_through_the_entry_point_and_listed(capsys):
    info = {b.name: b for b in offload_core.list_backends()}["xpu"]
    assert info.entry_point == "xpu = offload_core_xpu" and info.source == "offload-core"
    assert info.cls is XpuBackend and info.cls.is_accelerator and info.in_tree
    assert cli.main(["backends"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines() if line.strip()}
    assert rows["xpu"].split()[1:3] == ["offload-core", "yes" if XpuBackend.probe() else "no"]


@no_xpu_build
def test_unavailable_on_a_build_without_xpu_with_the_reason():
    assert XpuBackend.probe() is False
    assert XpuBackend.unavailable_reason() == f"this torch build ({torch.__version__}) has no XPU support"
    with pytest.raises(BackendUnavailableError, match="has no XPU support"):
        offload_core.get_backend("xpu")


def test_probing_initialises_no_xpu_state():
    result = run_python(
        """
        import json, torch
        from offload_core_xpu import XpuBackend
        probed = XpuBackend.probe()
        print(json.dumps({"probe": probed, "initialized": torch.xpu.is_initialized()}))
        """
    )
    assert result["initialized"] is False


def test_every_abstract_method_is_implemented_with_a_compatible_signature():
    assert not XpuBackend.__abstractmethods__
    problems = {name: signature_problems(getattr(DeviceBackend, name), getattr(XpuBackend, name))
                for name in DeviceBackend.__abstractmethods__}
    assert {k: v for k, v in problems.items() if v} == {}


@pytest.mark.parametrize("xccl, expected", [(True, "xccl"), (False, "gloo"), (None, "gloo")])
def test_collectives_through_xccl_where_torch_has_it(xccl, expected):
    """``is_xccl_available`` is new in torch 2.8 (None: an older torch); without XCCL there is no
    collective library for XPU tensors, so the backend lists no collectives capability."""
    patch = "" if xccl is None else f"dist.is_xccl_available = lambda: {xccl}"
    result = run_python(
        f"""
        import json
        import torch.distributed as dist
        if hasattr(dist, "is_xccl_available"):
            del dist.is_xccl_available
        {patch}
        from offload_core_xpu import XpuBackend
        print(json.dumps({{"dist": XpuBackend.dist_backend, "collectives": "collectives" in XpuBackend.capabilities,
                          "timing": "timing" in XpuBackend.capabilities}}))
        """
    )
    assert result == {"dist": expected, "collectives": bool(xccl), "timing": True}


@pytest.mark.parametrize(
    "torch_names, expected",
    [
        (dict(host_empty_cache=False, accelerator_empty=True, accelerator="xpu"), "accelerator.empty_host_cache"),
        (dict(host_empty_cache=True, accelerator_empty=False, accelerator="xpu"), None),  # never CUDA's call
        (dict(host_empty_cache=False, accelerator_empty=True, accelerator="cuda"), None),  # another device's
    ],
)
def test_the_host_cache_is_emptied_by_the_generic_name_only(monkeypatch, torch_names, expected):
    """torch.xpu has no host-cache call of its own: torch.accelerator.empty_host_cache (2.12 and
    later) when XPU is torch's accelerator, never ``torch._C._host_emptyCache`` (CUDA builds)."""
    recorder = Recorder()
    monkeypatch.setattr("offload_core.device.accelerator.torch", torch_as_of(recorder, **torch_names))
    emptier = XpuBackend.host_cache_emptier(object.__new__(XpuBackend))
    if emptier is not None:
        emptier()
    assert recorder.calls == ([expected] if expected else [])


# -- the stand-in torch.xpu -------------------------------------------------------------------------


def test_the_stand_in_names_only_what_torch_xpu_has():
    names = {n for n in dir(StandInXpu) if not n.startswith("_")}
    assert sorted(n for n in names if not hasattr(torch.xpu, n)) == []


def test_the_conformance_kit_passes_against_the_stand_in(tmp_path):
    """``pytest --backend=xpu-stand-in --pyargs offload_core.testing``, as a vendor runs it, with the
    stand-in registered through an installed entry point; collectives over two spawned ranks."""
    site = write_installed(tmp_path / "site", "xpu-standin-plugin", "xpu-stand-in", "xpu_standin_plugin",
                           "from xpu_standin import offload_core_register_backends  # noqa: F401\n")
    env = plugin_env(site)
    env["PYTHONPATH"] = f"{env['PYTHONPATH']}:{TESTS}"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--backend=xpu-stand-in", "--pyargs", "offload_core.testing",
         "-q", "-rA", "-p", "no:cacheprovider", "-p", "no:randomly"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed, failed = outcomes(proc.stdout)
    assert not failed
    assert {"test_collectives.py::test_all_gather_on_a_side_stream_across_two_ranks",
            "test_events.py::test_query_is_false_until_synchronize_returns",
            "test_timing.py::test_elapsed_time_spans_the_work_between_two_events",
            "test_streams.py::test_use_stream_selects_and_restores_the_current_stream"} <= passed


@pytest.fixture
def stand_in():
    backend = StandInXpuBackend()
    yield backend
    backend.synchronize()
    backend.close()


def test_the_stand_in_queues_copies_on_the_side_stream(stand_in):
    """What makes the kit meaningful here: a copy issued on a side stream has not run when the call
    returns (it waits behind slow work), and an event recorded after it says so."""
    side = stand_in.new_stream()
    ballast_src, ballast_dst = stand_in.empty_pinned(64 << 20), stand_in.empty_device(64 << 20)
    src, dst = stand_in.empty_pinned(16, torch.float32), stand_in.empty_device(16, torch.float32)
    src.fill_(3)
    dst.zero_()
    stand_in.copy_async(ballast_dst, ballast_src, side)
    stand_in.copy_async(dst, src, side)
    done = stand_in.new_event()
    done.record(side)
    assert not done.query()
    done.wait()  # the current (default) stream waits: the host, here
    assert torch.equal(dst, torch.full((16,), 3.0))


@pytest.mark.parametrize("options", [{"enable_layerwise_offload": True, "prefetch_depth": 2},
                                     {"enable_layerwise_offload": True, "pinned_memory": 0},
                                     {"enable_cpu_offload": True}], ids=["layerwise", "staged", "model-level"])
def test_strategies_run_exactly_on_the_stand_in_with_one_stream_switch_per_block(stand_in, options):
    from stacks import StackSpec, build_stack

    model = build_stack(StackSpec(d=8, layer_dtypes=[[torch.float32, torch.bfloat16]] * 4, tie_within=True))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = [model(x + i) for i in range(3)]
    handle = offload_core.enable_offload(model, backend=stand_in, **options)
    with torch.no_grad():
        for i in range(3):
            switches, loads = stand_in.stream_switches, handle.stats()["loads"]
            assert torch.equal(model(x + i), expected[i])
            switches, loads = stand_in.stream_switches - switches, handle.stats()["loads"] - loads
            assert 0 < switches <= loads  # the device module's stream() contexts, one per block at most
    handle.disable()
    gc.collect()
    with torch.no_grad():
        assert torch.equal(model(x), expected[0])
    assert Capability.COLLECTIVES in stand_in.capabilities
