"""The CUDA and NPU backends and their shared base, on a machine without either device.

What can be checked without hardware is checked here: the plugins import and register without a
vendor runtime, probing initialises nothing, construction fails clearly where the device is
absent, the classes implement the whole ABC, and the base class's own logic (device binding,
process-group setup, collective waits, copy validation) against a stand-in device module. What
needs a device is the conformance kit: ``pytest --backend=cuda --pyargs offload_core.testing``.
"""

from __future__ import annotations

import functools
import gc
import importlib.util
import sys
import threading
import types
from pathlib import Path

import pytest
import torch

import offload_core
from offload_core.device import collectives as offload_dist
from offload_core.device.accelerator import AcceleratorBackend, BackendUnavailableError, CollectiveWork
from offload_core.device.backend import Capability, DeviceBackend
from offload_core.device.memory_accounting import AllocationTracker
from offload_core.device.plugins import registry
from offload_core_cuda import CudaBackend
from offload_core_npu import NpuBackend

from helpers import free_port
from vendor import (
    COMPUTE, DEFAULT, GATHER, NPU_ONLY, VENDOR, Recorder, StandInModule, VendorEvent, VendorModule, VendorStream,
    run_python, signature_problems, torch_as_of,
)

REPO = Path(__file__).resolve().parents[2]
VENDOR_NAMES = ("torch.cuda", "torch.npu", "torch_npu")

no_cuda_build = pytest.mark.skipif(
    torch.version.cuda is not None or torch.version.hip is not None, reason="this torch build has CUDA"
)
no_npu_runtime = pytest.mark.skipif(importlib.util.find_spec("torch_npu") is not None, reason="torch_npu is installed")

pytestmark = pytest.mark.quick  # the CUDA and NPU backend paths, in the quick subset (pytest -m quick)


# -- plugins: import, registration, probing ----------------------------------------------------


def test_plugins_import_and_list_without_importing_the_npu_runtime(fake_torch_npu):
    # An importable (stand-in) torch_npu on the path, so that importing it too early would show.
    result = run_python(
        """
        import json, sys
        import offload_core_npu, offload_core_cuda
        after_import = "torch_npu" in sys.modules
        import offload_core
        names = [b.name for b in offload_core.list_backends()]
        print(json.dumps({"after_import": after_import, "after_list": "torch_npu" in sys.modules, "names": names}))
        """,
        pythonpath=fake_torch_npu,
        env={"FAKE_NPU_COUNT": "1"},
    )
    assert result["after_import"] is False
    assert result["after_list"] is False
    assert {"cuda", "npu"} <= set(result["names"])


def test_probing_cuda_creates_no_cuda_context():
    # Holds on a GPU machine too: probe() may be true there, but must not initialise CUDA.
    result = run_python(
        """
        import json, torch
        from offload_core_cuda import CudaBackend
        from offload_core import list_backends
        probed = CudaBackend.probe()
        listed = {b.name: b.available for b in list_backends()}
        print(json.dumps({"probe": probed, "listed": listed["cuda"], "initialized": torch.cuda.is_initialized()}))
        """
    )
    assert result["initialized"] is False
    assert result["probe"] == result["listed"]


@no_cuda_build
def test_cuda_probe_is_false_on_a_cpu_build():
    assert CudaBackend.probe() is False
    assert "no CUDA support" in CudaBackend.unavailable_reason()


@no_npu_runtime
def test_npu_probe_is_false_without_torch_npu():
    assert NpuBackend.probe() is False
    assert NpuBackend.unavailable_reason() == "torch_npu is not installed"
    assert "torch_npu" not in sys.modules


@pytest.mark.parametrize("name, module", [("cuda", "offload_core_cuda"), ("npu", "offload_core_npu")])
def test_registered_through_the_entry_point_as_in_tree_accelerators(name, module):
    info = {b.name: b for b in offload_core.list_backends()}[name]
    assert info.source == "offload-core"
    assert info.entry_point == f"{name} = {module}"
    assert info.cls.is_accelerator and info.in_tree
    assert info.rank()[0] == 1  # below vendor accelerators, above the simulator


@no_cuda_build
@no_npu_runtime
def test_both_show_as_unavailable_and_auto_detection_skips_them():
    listed = {b.name: b.available for b in offload_core.list_backends()}
    assert listed["cuda"] is False and listed["npu"] is False
    chosen, _ = registry().auto()
    assert chosen.name not in ("cuda", "npu")


@pytest.mark.parametrize(
    "name, reason",
    [
        pytest.param("cuda", "no CUDA support", marks=no_cuda_build),
        pytest.param("npu", "torch_npu is not installed", marks=no_npu_runtime),
    ],
)
def test_get_backend_of_an_absent_device_raises_a_clear_error(name, reason):
    with pytest.raises(BackendUnavailableError) as err:
        offload_core.get_backend(name)
    assert isinstance(err.value, RuntimeError)
    assert f"offload backend {name!r} cannot be used in this process" in str(err.value)
    assert reason in str(err.value)


# -- the whole ABC is implemented ------------------------------------------------------------


@pytest.mark.parametrize("cls", [CudaBackend, NpuBackend])
def test_every_abstract_method_is_implemented_with_a_compatible_signature(cls):
    assert not cls.__abstractmethods__
    problems = {}
    for name in sorted(DeviceBackend.__abstractmethods__):
        found = signature_problems(getattr(DeviceBackend, name), getattr(cls, name))
        if found:
            problems[name] = found
    assert problems == {}


def test_the_signature_check_can_fail():
    def abc_method(self, dst, src, stream=None): ...

    def renamed(self, dst, source, stream=None): ...

    def required_stream(self, dst, src, stream): ...

    assert signature_problems(abc_method, renamed) == ["lacks parameter 'src'", "adds required parameter 'source'"]
    assert signature_problems(abc_method, required_stream) == ["makes optional parameter 'stream' required"]


def test_torch_generic_stream_and_event_satisfy_the_abc_protocols():
    # The base returns torch.Stream / torch.Event unwrapped; strategies check these protocols.
    assert isinstance(torch.Stream(device="cpu"), offload_core.Stream)
    assert isinstance(torch.Event(device="cpu"), offload_core.Event)


def test_core_modules_of_this_layer_name_no_vendor_module():
    for path in ("device/accelerator.py", "device/memory_accounting.py", "cli/__init__.py", "__main__.py"):
        text = (REPO / "offload_core" / path).read_text()
        assert [n for n in VENDOR_NAMES if n in text] == [], path


# -- the NPU runtime is imported only by probing (a stand-in torch_npu) ------------------------

FAKE_TORCH_NPU = """
import builtins, os, sys, types
import torch
builtins.fake_npu_imports = getattr(builtins, "fake_npu_imports", 0) + 1
if os.environ.get("FAKE_NPU_BROKEN"):
    raise ImportError("libascendcl.so: cannot open shared object file")
npu = types.ModuleType("torch.npu")
npu.is_available = lambda: int(os.environ["FAKE_NPU_COUNT"]) > 0
npu.device_count = lambda: int(os.environ["FAKE_NPU_COUNT"])
torch.npu = npu
"""

PROBE_SCRIPT = """
import builtins, json, sys
import offload_core
from offload_core_npu import NpuBackend
imported_by_listing = "torch_npu" in sys.modules
listed = [b.name for b in offload_core.list_backends()]
first, second = NpuBackend.probe(), NpuBackend.probe()
print(json.dumps({
    "imported_by_listing": imported_by_listing,
    "probe": [first, second],
    "imported_by_probe": "torch_npu" in sys.modules,
    "imports": getattr(builtins, "fake_npu_imports", 0),
    "reason": None if first else NpuBackend.unavailable_reason(),
}))
"""


@pytest.fixture
def fake_torch_npu(tmp_path: Path) -> Path:
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(FAKE_TORCH_NPU)
    return tmp_path


@pytest.mark.parametrize("count, expected", [(0, False), (2, True)])
def test_npu_probe_imports_the_runtime_only_when_probing(fake_torch_npu, count, expected):
    result = run_python(PROBE_SCRIPT, pythonpath=fake_torch_npu, env={"FAKE_NPU_COUNT": str(count)})
    assert result["imported_by_listing"] is False
    assert result["probe"] == [expected, expected]
    assert result["imported_by_probe"] is True
    assert result["imports"] == 1
    if not expected:
        assert result["reason"] == "torch_npu found no NPU device"


def test_a_broken_npu_runtime_is_unavailable_with_its_error_and_not_reimported(fake_torch_npu):
    result = run_python(PROBE_SCRIPT, pythonpath=fake_torch_npu, env={"FAKE_NPU_COUNT": "1", "FAKE_NPU_BROKEN": "1"})
    assert result["probe"] == [False, False]
    assert result["imports"] == 1  # the failure is remembered, not retried on every listing
    assert result["reason"] == "importing torch_npu failed: ImportError: libascendcl.so: cannot open shared object file"


# -- the base class against a stand-in device module -----------------------------------------


class StandInBackend(AcceleratorBackend):
    name = "stand-in"
    device_type = "cuda"  # torch.device("cuda", i) can be built without CUDA; nothing runs on it
    dist_backend = "nccl"
    present = True

    @classmethod
    def probe(cls) -> bool:
        return cls.present

    def _device_module(self):
        return StandInModule()


def test_constructing_an_unavailable_backend_raises_with_the_reason(monkeypatch):
    monkeypatch.setattr(StandInBackend, "present", False)
    expected = "'stand-in' cannot be used in this process: no cuda device is visible"
    with pytest.raises(BackendUnavailableError, match=expected):
        StandInBackend()


def test_device_follows_the_current_device_and_checks_indices():
    backend = StandInBackend()
    assert backend.device() == torch.device("cuda", 0)
    backend._mod.set_device(3)
    assert backend.device() == torch.device("cuda", 3)
    assert backend.device(1) == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="index 4 is out of range: 4 device"):
        backend.device(4)


def test_synchronize_touches_only_devices_the_backend_used():
    backend = StandInBackend()
    backend.device(2)
    backend.synchronize()
    assert backend._mod.calls == [("synchronize", 0), ("synchronize", 2)]


@pytest.mark.parametrize("bind, rank, index", [(True, 6, 2), (False, 1, 1)])
def test_init_process_group_binds_rank_to_a_device_before_joining(monkeypatch, bind, rank, index):
    joined = []

    def fake_init(dist_backend, rank, world_size, init_method, **kwargs):
        joined.append((dist_backend, rank, world_size, init_method, kwargs, list(backend._mod.calls)))

    monkeypatch.setattr(offload_dist, "init_process_group", fake_init)
    monkeypatch.setattr(StandInBackend, "bind_device_id", bind)
    backend = StandInBackend()
    backend.init_process_group(rank, 8, "tcp://127.0.0.1:1")
    expected_kwargs = {"device_id": torch.device("cuda", index)} if bind else {}
    assert joined == [("nccl", rank, 8, "tcp://127.0.0.1:1", expected_kwargs, [("set_device", index)])]


class StandInWork:
    """A torch.distributed Work that completes after a few polls and records where it was waited."""

    def __init__(self, module: StandInModule, polls: int) -> None:
        self.module, self.polls, self.waited_on = module, polls, []

    def is_completed(self) -> bool:
        self.polls -= 1
        return self.polls < 0

    def wait(self) -> bool:
        self.waited_on.append(self.module.current_stream(None))
        return True


def test_all_gather_is_issued_on_the_given_stream_and_waited_on_the_waiter(monkeypatch):
    backend = StandInBackend()
    issued_on = []
    work = StandInWork(backend._mod, polls=3)

    def fake_gather(output, input, group=None, async_op=False):
        issued_on.append((backend._mod.current_stream(None), async_op))
        return work

    monkeypatch.setattr(offload_dist, "all_gather", fake_gather)
    out, inp = torch.empty(4), torch.ones(2)
    handle = backend.all_gather_into_tensor(out, inp, stream=GATHER)
    assert isinstance(handle, CollectiveWork) and isinstance(handle, offload_core.Waitable)
    assert issued_on == [(GATHER, True)]
    handle.wait(COMPUTE)
    handle.wait()  # default: the current stream
    assert work.waited_on == [COMPUTE, DEFAULT]
    assert handle.query() is False
    handle.synchronize()  # polls until complete, then surfaces errors through wait()
    assert work.polls < 0 and len(work.waited_on) == 3


def test_copy_async_rejects_mismatched_and_host_only_copies():
    backend = StandInBackend()
    with pytest.raises(ValueError, match="equal shapes and dtypes"):
        backend.copy_async(torch.empty(3), torch.empty(4))
    with pytest.raises(ValueError, match="equal shapes and dtypes"):
        backend.copy_async(torch.empty(3), torch.empty(3, dtype=torch.float16))
    with pytest.raises(ValueError, match="to or from a cuda device, got dst on cpu and src on cpu"):
        backend.copy_async(torch.empty(3), torch.empty(3))


# -- pinned-byte accounting (the tracker shared with the fake backend) -------------------------


def test_tracker_follows_storage_lifetime_not_tensor_lifetime():
    tracker = AllocationTracker("test memory")
    t = tracker.allocate((4, 8), torch.float32)
    view = t[1:]
    del t
    gc.collect()
    assert tracker.current == 128 and tracker.owns(view)
    del view
    gc.collect()
    assert tracker.current == 0 and tracker.peak == 128


def test_tracker_cap_raises_the_given_error_and_a_failed_allocation_leaks_nothing():
    class Refused(torch.OutOfMemoryError):
        pass

    tracker = AllocationTracker("test memory", capacity=100, oom_error=Refused)
    with pytest.raises(Refused, match="test memory out of memory: tried to allocate 400 bytes"):
        tracker.allocate(100, torch.float32)

    def failing_factory(shape, dtype):
        raise RuntimeError("allocator refused")

    with pytest.raises(RuntimeError, match="allocator refused"):
        tracker.allocate(10, torch.uint8, failing_factory)
    assert tracker.current == 0


# -- streams and events through the device module (a stand-in whose generic streams raise) ------


def test_streams_and_events_come_from_the_device_module(vendor_backend):
    backend = vendor_backend
    side = backend.new_stream()
    assert isinstance(side, VendorStream)
    assert backend.current_stream() is VENDOR.default  # the module's stream, not a rewrap
    with backend.use_stream(side):
        assert backend.current_stream() is side
    event = backend.new_event()
    assert isinstance(event, VendorEvent)
    event.record(side)
    event.wait(backend.current_stream())
    event.record()  # the current stream by default
    assert event.recorded_on is VENDOR.default
    backend.wait_stream(side, backend.current_stream())
    assert isinstance(offload_core.Stream, type) and isinstance(side, offload_core.Stream)
    assert isinstance(event, offload_core.Event)


def test_a_strategy_runs_end_to_end_on_device_module_streams(vendor_backend):
    from stacks import StackSpec, build_stack

    model = build_stack(StackSpec(d=8, layer_dtypes=[[torch.float32, torch.bfloat16]] * 4, tie_within=True))
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = [model(x + i) for i in range(3)]
        for options in ({"enable_layerwise_offload": True, "prefetch_depth": 2}, {"enable_cpu_offload": True}):
            handle = offload_core.enable_offload(model, backend=vendor_backend, **options)
            for i in range(3):
                assert torch.equal(model(x + i), expected[i])
            assert handle.stats()["pinned_host_bytes"] > 0
            handle.disable()
            assert torch.equal(model(x), expected[0])
    assert VENDOR.host_cache_emptied >= 2  # disable gave the cached pinned blocks back


def test_mem_get_info_counts_the_allocators_idle_reserve_as_free(vendor_backend):
    # The driver sees 6 GB free of 16; the caching allocator holds 5 GB, of which 2 GB are in use:
    # the 3 GB it holds idle are what new allocations get first.
    VENDOR.total, VENDOR.driver_free, VENDOR.reserved, VENDOR.allocated = 16 << 30, 6 << 30, 5 << 30, 2 << 30
    assert vendor_backend.mem_get_info() == (9 << 30, 16 << 30)


def test_accelerator_pinned_accounting_models_the_caching_host_allocator(vendor_backend):
    backend = vendor_backend
    assert backend.pinned_allocation_size(600_000) == 1 << 20
    t = backend.empty_pinned(600_000)
    assert backend.pinned_memory_allocated() == 1 << 20  # rounded up to a power of two
    del t
    gc.collect()
    assert backend.pinned_memory_allocated() == 1 << 20  # the freed block stays cached
    emptied = VENDOR.host_cache_emptied
    backend.empty_host_cache()
    assert VENDOR.host_cache_emptied == emptied + 1 and backend.pinned_memory_allocated() == 0


# -- the collective timeout ------------------------------------------------------------------


def test_collective_timeout_is_torchs_default_unless_the_user_sets_one(monkeypatch):
    import datetime

    import torch.distributed as dist

    joined: list[dict] = []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda *args, **kwargs: joined.append(kwargs))
    backend = offload_core.get_backend("fake", chaos=False)
    backend.init_process_group(0, 1, "tcp://127.0.0.1:1")
    assert "timeout" not in joined[-1]  # torch's default for the collective backend
    backend.init_process_group(0, 1, "tcp://127.0.0.1:1", timeout=90)
    assert joined[-1]["timeout"] == datetime.timedelta(seconds=90)
    backend.init_process_group(0, 1, "tcp://127.0.0.1:1", timeout=datetime.timedelta(hours=1))
    assert joined[-1]["timeout"] == datetime.timedelta(hours=1)
    with pytest.raises(TypeError, match="timeout must be a datetime.timedelta or a number of seconds, got '1m'"):
        backend.init_process_group(0, 1, "tcp://127.0.0.1:1", timeout="1m")
    with pytest.raises(ValueError, match="timeout must be positive, got 0"):
        backend.init_process_group(0, 1, "tcp://127.0.0.1:1", timeout=0)
    assert len(joined) == 3


# -- the stand-ins name only what the real modules have ------------------------------------------


@pytest.mark.parametrize("stand_in", [StandInModule, VendorModule])
def test_stand_in_device_modules_have_only_names_the_real_modules_have(stand_in):
    # torch.cuda exists in every torch build, CUDA or not: its names are the reference
    names = {n for n in dir(stand_in) if not n.startswith("_")} - {"calls", "stream_stack", "count", "current"}
    names -= {"default", "allocated", "reserved", "driver_free", "total", "host_cache_emptied"}  # recorded state
    assert sorted(n for n in names - NPU_ONLY if not hasattr(torch.cuda, n)) == []
    assert not hasattr(torch.cuda, "empty_host_cache")  # what accelerator.py used to call


# -- the pinned host cache, by the names each torch and torch_npu version has ---------------------


class StandInCuda(CudaBackend):
    @classmethod
    def probe(cls) -> bool:
        return True

    def _device_module(self):
        return StandInModule()


class NpuModule(StandInModule):
    """torch_npu's device module as far as the host cache goes: ``host_empty_cache`` where the
    installed torch_npu has it."""

    def __init__(self, recorder: Recorder | None) -> None:
        super().__init__()
        if recorder is not None:
            self.host_empty_cache = recorder("npu.host_empty_cache")


class StandInNpu(NpuBackend):
    module: NpuModule

    @classmethod
    def probe(cls) -> bool:
        return True

    def _device_module(self):
        return self.module


@pytest.mark.parametrize(
    "backend_class, torch_names, npu_has_it, expected",
    [
        (StandInCuda, dict(host_empty_cache=True, accelerator_empty=False, accelerator="cuda"), None,
         "_C._host_emptyCache"),  # torch 2.6 to 2.11, CUDA build
        (StandInCuda, dict(host_empty_cache=True, accelerator_empty=True, accelerator="cuda"), None,
         "_C._host_emptyCache"),  # torch 2.12 and later, CUDA build
        (StandInCuda, dict(host_empty_cache=False, accelerator_empty=True, accelerator="cuda"), None,
         "accelerator.empty_host_cache"),  # a build without the private name
        (StandInCuda, dict(host_empty_cache=False, accelerator_empty=False, accelerator=None), None,
         None),  # torch 2.6 to 2.11 without CUDA: nothing to call
        (StandInNpu, dict(host_empty_cache=False, accelerator_empty=False, accelerator="npu"), True,
         "npu.host_empty_cache"),  # torch_npu with its own name, on torch 2.6 to 2.11
        (StandInNpu, dict(host_empty_cache=False, accelerator_empty=True, accelerator="npu"), False,
         "accelerator.empty_host_cache"),  # a torch_npu without it, on torch 2.12 and later
        (StandInNpu, dict(host_empty_cache=False, accelerator_empty=True, accelerator="cuda"), False,
         None),  # torch's accelerator is another device: its host cache is not ours to empty
        (StandInNpu, dict(host_empty_cache=True, accelerator_empty=False, accelerator="npu"), False,
         None),  # never CUDA's _host_emptyCache, which torch_npu does not support
    ],
)
def test_the_host_cache_is_emptied_by_the_names_this_torch_has(monkeypatch, backend_class, torch_names, npu_has_it,
                                                                expected):
    recorder = Recorder()
    stand_in = torch_as_of(recorder, **torch_names)
    monkeypatch.setattr("offload_core.device.accelerator.torch", stand_in)
    monkeypatch.setattr("offload_core_cuda.torch", stand_in)
    monkeypatch.setattr("offload_core_npu.torch", stand_in)
    monkeypatch.setattr("offload_core.device.accelerator._pinned_empty", lambda shape, dtype: torch.empty(shape, dtype=dtype))
    if backend_class is StandInNpu:
        monkeypatch.setattr(StandInNpu, "module", NpuModule(recorder if npu_has_it else None), raising=False)
    backend = backend_class()
    block = backend.empty_pinned(1000)
    del block
    gc.collect()
    assert backend.pinned_memory_allocated() == 1024  # freed, still cached by the host allocator
    assert (Capability.HOST_CACHE in backend.capabilities) == (expected is not None)
    backend.empty_host_cache()
    assert recorder.calls == ([expected] if expected else [])
    # the count follows what is really held: emptied only where the cache really was
    assert backend.pinned_memory_allocated() == (0 if expected else 1024)


# -- compiler.disable's reason=, where the signature has it -----------------------------------------


@pytest.mark.parametrize("takes_reason", [False, True])  # torch 2.6 and 2.7 / 2.8 and later
def test_compiler_disable_gets_a_reason_only_where_it_takes_one(monkeypatch, takes_reason):
    from offload_core.strategies.calls import CallWrapper

    seen: list[dict] = []
    if takes_reason:
        def disable(fn=None, recursive=True, *, reason=None):
            seen.append({"recursive": recursive, "reason": reason})
            return fn
    else:
        def disable(fn=None, recursive=True):
            seen.append({"recursive": recursive})
            if not recursive:
                fn._torchdynamo_disable = True  # what torch 2.6's skip() does: a bound method cannot take it
            return fn
    monkeypatch.setattr(torch.compiler, "disable", disable)
    module = torch.nn.Linear(2, 2)
    ran: list[str] = []
    wrapper = CallWrapper(module, before=lambda: ran.append("before"), after=lambda failed: ran.append("after"))
    wrapper.install()
    module(torch.ones(1, 2))
    assert ran == ["before", "after"]
    # the work before and after the call, and the two frames that hold the lock and run the call
    assert [s["recursive"] for s in seen] == [True, True, False, False]
    assert all(("reason" in s) == takes_reason for s in seen)
    if takes_reason:
        assert all("regional compilation" in s["reason"] for s in seen)
    wrapper.remove()


# -- the all-gather by the names this torch.distributed has ------------------------------------------


def distributed_as_of(calls: list, *names: str):
    """A ``torch.distributed`` with only ``names`` of the gather family (and the world size)."""
    def named(name):
        def call(output, input, group=None, async_op=False):
            calls.append(name)
            if name == "all_gather":
                for rank, part in enumerate(output):
                    part.copy_(input + rank)
            else:
                output.view(-1).copy_(torch.cat([input + r for r in range(output.numel() // input.numel())]))
            return "work"
        return call

    return types.SimpleNamespace(get_world_size=lambda group=None: 3, **{n: named(n) for n in names})


@pytest.mark.parametrize(
    "names, used",
    [
        (("all_gather_single", "all_gather_into_tensor", "all_gather"), "all_gather_single"),  # torch 2.13+
        (("all_gather_into_tensor", "all_gather"), "all_gather_into_tensor"),  # torch 2.6 to 2.12
        (("all_gather",), "all_gather"),  # neither tensor-output name: a list of views of the output
    ],
)
def test_all_gather_uses_the_first_name_this_torch_has(monkeypatch, names, used):
    calls: list = []
    monkeypatch.setattr(offload_dist, "dist", distributed_as_of(calls, *names))
    output = torch.zeros(2, 3)
    assert offload_dist.all_gather(output, torch.tensor([1.0, 2.0]), async_op=True) == "work"
    assert calls == [used]
    assert output.flatten().tolist() == [1.0, 2.0, 2.0, 3.0, 3.0, 4.0]


def _list_gather_worker(rank: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
    without = types.ModuleType("torch.distributed")  # the real module less its tensor-output gathers
    without.__getattr__ = lambda name: (
        getattr(dist, name) if name not in ("all_gather_single", "all_gather_into_tensor") else None
    )
    offload_dist.dist = without
    output = torch.zeros(2, 3)
    offload_dist.all_gather(output, torch.arange(3.0) + 10 * rank, async_op=True).wait()
    assert output.tolist() == [[0.0, 1.0, 2.0], [10.0, 11.0, 12.0]]
    dist.destroy_process_group()


def test_the_list_fallback_gathers_in_rank_order_with_real_gloo():
    import torch.multiprocessing as mp

    mp.spawn(_list_gather_worker, args=(free_port(),), nprocs=2, join=True)


# -- a thread bound to the rank's device ---------------------------------------------------------


class ThreadLocalModule(StandInModule):
    """A device module whose current device is per thread, as a device runtime's is."""

    def __init__(self) -> None:
        super().__init__()
        self._local = threading.local()

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def set_device(self, index: int) -> None:
        self.calls.append(("set_device", index))
        self._local.index = index


def test_bind_thread_sets_the_calling_threads_device_and_the_stager_binds_first(monkeypatch):
    from offload_core.hostmem.staging import Stager

    module = ThreadLocalModule()
    monkeypatch.setattr(StandInBackend, "_device_module", lambda self: module)
    backend = StandInBackend()
    module.set_device(3)  # this rank's device, on the enabling thread
    stager = Stager(on_start=functools.partial(backend.bind_thread, backend.device()))
    seen: list[torch.device] = []
    stager.wait(stager.submit(lambda: seen.append(backend.device())))
    stager.close()
    assert seen == [torch.device("cuda", 3)]  # a new thread starts on device 0 without the binding
    unbound = Stager()
    unbound.wait(unbound.submit(lambda: seen.append(backend.device())))
    unbound.close()
    assert seen[-1] == torch.device("cuda", 0)
