"""The core never names a vendor module (docs/design.md): strategies reach devices only through a
backend, so offload_core imports and runs on machines without CUDA or torch_npu, and a new
vendor needs no change to it. Vendor code belongs in backends/.

Nor does the core know the fake backend, the CPU simulator the tests run on: it does not import
``offload_core_fake``, names none of the simulator's capabilities (chaos, capacity, bandwidth,
trace, sanitize: :class:`offload_core.testing.SimulatorCapability`), reads none of its
``OFFLOAD_CORE_FAKE_*`` variables, and does not ask whether the backend's device is the CPU (the
fake's device) to decide what to do. ``offload_core/testing/`` (the pytest plugin and the
conformance kit, which drive simulators) is outside the core; so is the benchmark that measures
the fake's sanitizer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import offload_core
from offload_core.testing import SimulatorCapability

CORE = Path(offload_core.__file__).resolve().parent
VENDOR = re.compile(r"torch\.cuda|torch\.npu|torch_npu")
#: relative to CORE: what may know the fake backend, and why
NOT_CORE = {
    "testing": "the pytest plugin and the conformance kit switch simulator features on",
    "bench/sanitizer.py": "measures the fake backend's own race sanitizer",
}
SIMULATOR_NAMES = {k for k in vars(SimulatorCapability) if k.isupper()}
FAKE_VARIABLE = re.compile(r"^OFFLOAD_CORE_FAKE_\w+$")


def _core_files() -> list[Path]:
    return [
        path for path in sorted(CORE.rglob("*.py"))
        if not any(path.relative_to(CORE).as_posix().startswith(prefix) for prefix in NOT_CORE)
    ]


def _asks_if_the_device_is_the_cpu(node: ast.Compare) -> bool:
    """``<x>.device(...).type == "cpu"`` (or ``!=``), either side."""
    sides = [node.left, *node.comparators]
    device_type = any(
        isinstance(s, ast.Attribute) and s.attr == "type" and isinstance(s.value, ast.Call)
        and isinstance(s.value.func, ast.Attribute) and s.value.func.attr == "device"
        for s in sides
    )
    return device_type and any(isinstance(s, ast.Constant) and s.value == "cpu" for s in sides)


def fake_knowledge(source: str) -> list[tuple[int, str]]:
    """(line, what) for each place ``source`` knows the fake backend."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, f"imports {a.name}") for a in node.names if a.name.split(".")[0] == "offload_core_fake"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "offload_core_fake":
            found.append((node.lineno, f"imports from {node.module}"))
        elif isinstance(node, ast.Attribute) and node.attr in SIMULATOR_NAMES and isinstance(node.value, ast.Name) \
                and node.value.id == "Capability":
            found.append((node.lineno, f"names Capability.{node.attr}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and FAKE_VARIABLE.match(node.value):
            found.append((node.lineno, f"reads {node.value}"))
        elif isinstance(node, ast.Compare) and _asks_if_the_device_is_the_cpu(node):
            found.append((node.lineno, "asks whether the backend's device is the CPU"))
    return found


def test_core_sources_name_no_vendor_module():
    offenders = [
        f"{path.relative_to(CORE.parent)}:{lineno}: {line.strip()}"
        for path in sorted(CORE.rglob("*.py"))
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if VENDOR.search(line)
    ]
    assert not offenders, "vendor modules named in offload_core/:\n" + "\n".join(offenders)


def test_the_core_does_not_know_the_fake_backend():
    offenders = [
        f"{path.relative_to(CORE.parent)}:{lineno}: {what}"
        for path in _core_files()
        for lineno, what in fake_knowledge(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "the core knows the fake backend:\n" + "\n".join(offenders)
    assert not SIMULATOR_NAMES & set(vars(offload_core.Capability)), "simulator capabilities in offload_core.Capability"


def test_the_scans_see_the_core_and_what_they_look_for():
    """Guard against a vacuous pass: the scans find the core's modules, and each kind of
    knowledge of the fake is caught in a sample."""
    names = {p.relative_to(CORE).as_posix() for p in _core_files()}
    assert {"device/backend.py", "device/plugins.py", "device/hookspecs.py", "strategies/part.py",
            "common/config.py"} <= names
    assert not any(name.startswith("testing/") for name in names)
    assert VENDOR.search("x = torch.cuda.Stream()") and VENDOR.search("import torch_npu")
    samples = {
        "import offload_core_fake": "imports offload_core_fake",
        "from offload_core_fake.sanitizer import paused": "imports from offload_core_fake.sanitizer",
        "x = Capability.CHAOS": "names Capability.CHAOS",
        "os.environ.get('OFFLOAD_CORE_FAKE_SANITIZE')": "reads OFFLOAD_CORE_FAKE_SANITIZE",
        "host_only = backend.device().type != 'cpu'": "asks whether the backend's device is the CPU",
    }
    for source, what in samples.items():
        assert fake_knowledge(source) == [(1, what)], source
    assert fake_knowledge("on_host = tensor.device.type == 'cpu'\nx = Capability.TIMING") == []
