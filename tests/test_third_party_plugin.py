"""A third-party backend is a peer of the in-tree ones: installed, listed, selected, validated.

The "acme-offload" distribution installed here is ``docs/examples/minimal_backend``, the example
``docs/backends.md`` walks a vendor through, so the documented plugin is exactly the tested one.
A second throwaway distribution holds a plugin that fails to import: it must be reported and
skipped without hiding the others. Installed packages are only visible to subprocesses (their
``PYTHONPATH``), so this process's registry is untouched.

The second half unit-tests the selection rules of :mod:`offload_core.device.plugins` in-process, on a
registry whose entries are replaced.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
from plugin_dists import pip_install, plugin_env, write_project

import offload_core
from offload_core import BackendNotFoundError, hookimpl
from offload_core.device.plugins import ENV_BACKEND, IN_TREE_DISTRIBUTION, BackendInfo, Registry
from offload_core_fake import FakeBackend

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "docs" / "examples" / "minimal_backend"
DOC = REPO / "docs" / "backends.md"

BROKEN_MODULE = 'raise ImportError("libacme_runtime.so: cannot open shared object file")\n'

# Run in a subprocess with the plugins on PYTHONPATH; prints what the registry saw, as JSON.
REPORT = r"""
import dataclasses, json, logging
logging.basicConfig(level=logging.WARNING, format="LOG %(levelname)s %(name)s: %(message)s")
import offload_core
from offload_core.device.plugins import registry

report = {
    "backends": [
        {"name": b.name, "source": b.source, "available": b.available, "priority": b.priority,
         "accelerator": b.cls.is_accelerator}
        for b in offload_core.list_backends()
    ],
    "failures": [dataclasses.asdict(f) for f in registry().failures],
}
named = offload_core.get_backend("acme")
report["named"] = [type(named).__module__, type(named).__name__, named.name]
chosen = offload_core.get_backend()
report["selected"], report["why"] = chosen.name, registry().resolve(None)[1]
try:
    offload_core.get_backend("no-such-backend")
except offload_core.BackendNotFoundError as exc:
    report["unknown"] = str(exc)
print("REPORT " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """Both distributions installed (one offline pip call) into a directory for PYTHONPATH.

    The example is copied first: building in place would leave build/ and *.egg-info in docs/."""
    root = tmp_path_factory.mktemp("third-party")
    acme = root / "acme-offload"
    shutil.copytree(EXAMPLE, acme, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    broken = write_project(root / "acme-broken", "acme-broken", "acme_broken", "acme_broken_plugin", BROKEN_MODULE)
    target = root / "site"
    pip_install(target, acme, broken)
    return target


def run_report(site: Path, **env: str) -> tuple[dict, str]:
    proc = subprocess.run(
        [sys.executable, "-c", REPORT], env={**plugin_env(site), **env}, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    line = next(line for line in proc.stdout.splitlines() if line.startswith("REPORT "))
    return json.loads(line[len("REPORT ") :]), proc.stderr


@pytest.fixture(scope="module")
def report(site) -> tuple[dict, str]:
    return run_report(site)


def test_listed_with_its_distribution_and_available(report):
    backends = {b["name"]: b for b in report[0]["backends"]}
    assert backends["acme"] == {"name": "acme", "source": "acme-offload", "available": True, "priority": 10, "accelerator": True}
    assert backends["fake"]["source"] == IN_TREE_DISTRIBUTION  # the in-tree ones are still there
    assert [b["name"] for b in report[0]["backends"]][0] == "acme"  # listed in detection order: first


def test_a_plugin_that_fails_to_import_is_reported_not_fatal(report):
    data, stderr = report
    [failure] = [f for f in data["failures"] if f["source"] == "acme-broken"]
    assert failure["entry_point"] == "acme_broken = acme_broken_plugin"
    assert "ImportError" in failure["error"] and "libacme_runtime" in failure["error"]
    assert re.search(r"LOG WARNING offload_core\.device\.plugins: .*acme_broken.*skipped.*libacme_runtime", stderr), stderr
    assert {"acme", "fake"} <= {b["name"] for b in data["backends"]}


def test_get_backend_by_name(report):
    assert report[0]["named"] == ["acme_offload", "AcmeBackend", "acme"]


def test_auto_detection_prefers_the_vendor_accelerator_to_the_fake(report):
    data, stderr = report
    assert data["selected"] == "acme"
    assert "third-party (acme-offload)" in data["why"]
    assert "no accelerator" not in stderr  # the simulator fallback warning is not given


def test_environment_variable_selects_the_backend(site):
    data, _ = run_report(site, **{ENV_BACKEND: "acme"})
    assert data["selected"] == "acme" and data["why"] == f"named by {ENV_BACKEND}"
    data, _ = run_report(site, **{ENV_BACKEND: "fake"})  # the variable outranks auto-detection
    assert data["selected"] == "fake" and data["why"] == f"named by {ENV_BACKEND}"


def test_a_backend_whose_probe_is_false_is_skipped_by_auto_detection(site):
    """The example's probe is false with ACME_VISIBLE_DEVICES empty: auto-detection then falls
    back to the simulator, with the logged warning; the name still selects it explicitly."""
    data, stderr = run_report(site, ACME_VISIBLE_DEVICES="")
    assert {b["name"]: b["available"] for b in data["backends"]}["acme"] is False
    best = next(b for b in data["backends"] if b["available"])  # listed in detection order
    assert data["selected"] == best["name"] != "acme"
    if not best["accelerator"]:  # the fake, on a machine without CUDA / NPU
        assert "LOG WARNING offload_core.device.plugins: no accelerator backend is available" in stderr
    assert data["named"][2] == "acme"


def test_unknown_name_lists_the_registered_names(report):
    message = report[0]["unknown"]
    assert "'no-such-backend'" in message
    names = re.search(r"registered backends: (.*)$", message).group(1).split(", ")
    assert {"acme", "fake"} <= set(names) and names == sorted(names)


def _pytest(site: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", *args, "-p", "no:cacheprovider"]
    return subprocess.run(cmd, env=plugin_env(site), cwd=site.parent, capture_output=True, text=True, timeout=300)


def test_conformance_kit_passes_for_the_plugin(site):
    """What a vendor runs to validate a backend; also checks the kit accepts a correct backend."""
    proc = _pytest(site, "--backend=acme", "--pyargs", "offload_core.testing")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert "offload_core backend: acme (chaos mode, race sanitizer) from acme-offload" in proc.stdout  # the header
    assert "acme_broken = acme_broken_plugin (acme-broken)" in proc.stdout  # the skipped plugin, shown
    assert re.search(r"\b(\d+) passed\b", proc.stdout) and " failed" not in proc.stdout


def test_pytest_unknown_backend_is_a_usage_error(site):
    proc = _pytest(site, "--backend=nope", "--pyargs", "offload_core.testing")
    assert proc.returncode == pytest.ExitCode.USAGE_ERROR, proc.stdout + proc.stderr
    assert "--backend=nope: unknown offload backend 'nope'; registered backends:" in proc.stderr
    assert "acme" in proc.stderr and "Traceback" not in proc.stdout + proc.stderr


def test_docs_show_the_tested_example_files():
    """Every ``<!-- file: PATH -->`` block in docs/backends.md is that file, verbatim."""
    text = DOC.read_text()
    blocks = re.findall(r"<!-- file: (\S+) -->\n```\w*\n(.*?)```\n", text, re.S)
    assert {path for path, _ in blocks} == {
        "docs/examples/minimal_backend/pyproject.toml",
        "docs/examples/minimal_backend/acme_offload.py",
    }
    for path, body in blocks:
        assert body == (REPO / path).read_text(), f"docs/backends.md shows an outdated copy of {path}"


# ---------------------------------------------------------------------------------------------
# Selection rules, in-process


def make(name: str, *, accelerator: bool, priority: int = 0, probe=True) -> type[FakeBackend]:
    """A concrete backend class with the given selection attributes."""

    def _probe(cls):
        if isinstance(probe, BaseException):
            raise probe
        return probe

    attrs = {"name": name, "is_accelerator": accelerator, "priority": priority, "probe": classmethod(_probe)}
    return type(f"B_{name}", (FakeBackend,), attrs)


@pytest.fixture
def reg(monkeypatch) -> Registry:
    """A registry with a vendor accelerator, an in-tree accelerator and a simulator, whose in-tree
    priorities are higher, so that only the tier rule can make the vendor win."""
    monkeypatch.delenv(ENV_BACKEND, raising=False)
    r = Registry()
    r.backends = {
        "vendor": BackendInfo("vendor", make("vendor", accelerator=True, priority=0), "acme-offload", "vendor = v"),
        "intree": BackendInfo("intree", make("intree", accelerator=True, priority=100), IN_TREE_DISTRIBUTION, "i = i"),
        "sim": BackendInfo("sim", make("sim", accelerator=False, priority=1000), IN_TREE_DISTRIBUTION, "sim = s"),
    }
    return r


def swap(r: Registry, name: str, **kwargs) -> None:
    info = r.backends[name]
    r.backends[name] = BackendInfo(name, make(name, **kwargs), info.source, info.entry_point)


def test_tiers_outrank_priority(reg):
    assert reg.auto()[0].name == "vendor"
    swap(reg, "vendor", accelerator=True, probe=False)
    assert reg.auto()[0].name == "intree"
    swap(reg, "intree", accelerator=True, probe=False)
    info, why = reg.auto()
    assert info.name == "sim" and "no accelerator" in why


def test_priority_orders_within_a_tier(reg):
    reg.backends["vendor2"] = BackendInfo("vendor2", make("vendor2", accelerator=True, priority=5), "other", "v2 = v2")
    assert reg.auto()[0].name == "vendor2"


def test_a_probe_that_raises_means_unavailable(reg, caplog):
    swap(reg, "vendor", accelerator=True, probe=RuntimeError("driver too old"))
    with caplog.at_level(logging.WARNING, logger="offload_core.device.plugins"):
        assert reg.auto()[0].name == "intree"
    assert "probe() of backend 'vendor' raised" in caplog.text


def test_explicit_name_beats_environment_beats_auto_detection(reg, monkeypatch):
    monkeypatch.setenv(ENV_BACKEND, "sim")
    assert reg.resolve(None)[0].name == "sim"
    assert reg.resolve("intree")[0].name == "intree"
    monkeypatch.setenv(ENV_BACKEND, "")  # empty means unset
    assert reg.resolve(None)[0].name == "vendor"


def test_explicitly_named_backend_need_not_probe_true(reg):
    """Naming a backend is the user's decision; its constructor reports what is missing."""
    swap(reg, "vendor", accelerator=True, probe=False)
    assert reg.resolve("vendor")[0].name == "vendor"


@pytest.mark.parametrize("where", ["argument", "environment"])
def test_unknown_names_list_the_registered_ones(reg, monkeypatch, where):
    if where == "environment":
        monkeypatch.setenv(ENV_BACKEND, "nope")
    with pytest.raises(BackendNotFoundError, match=r"unknown offload backend 'nope'; registered backends: intree, sim, vendor$"):
        reg.resolve("nope" if where == "argument" else None)


def test_nothing_available_is_an_error(reg):
    for name in ("vendor", "intree", "sim"):
        swap(reg, name, accelerator=name != "sim", probe=False)
    with pytest.raises(BackendNotFoundError, match="no offload backend is available"):
        reg.auto()


def test_simulator_fallback_is_logged(reg, caplog):
    for name in ("vendor", "intree"):
        swap(reg, name, accelerator=True, probe=False)
    with caplog.at_level(logging.WARNING, logger="offload_core.device.plugins"):
        chosen = reg.get(None, {})
    assert chosen.name == "sim"
    assert "no accelerator backend is available" in caplog.text


def test_instances_shared_without_options_fresh_with_them(reg):
    assert reg.get("vendor", {}) is reg.get("vendor", {})
    a, b = reg.get("vendor", {"chaos": True}), reg.get("vendor", {"chaos": True})
    try:
        assert a is not b and a.chaos and b.chaos
    finally:
        a.close()
        b.close()


def test_get_backend_accepts_an_instance():
    instance = FakeBackend()
    assert offload_core.get_backend(instance) is instance
    with pytest.raises(TypeError):
        offload_core.get_backend(instance, chaos=True)


def _module(monkeypatch, name: str, hook=None) -> str:
    module = types.ModuleType(name)
    if hook is not None:
        module.offload_core_register_backends = hookimpl(hook)
    monkeypatch.setitem(sys.modules, name, module)
    return name


def test_broken_plugins_are_skipped_and_reported(monkeypatch, caplog):
    """Import errors, raising hooks, non-backends, abstract classes and duplicate names each
    become one failure; the good plugin's backend is still registered."""
    good = make("good", accelerator=True)
    abstract = type("Abstract", (offload_core.DeviceBackend,), {"name": "abstract"})
    duplicate = make("good", accelerator=False)

    def raising(register):
        raise RuntimeError("hook exploded")

    eps = [
        EntryPoint("good", _module(monkeypatch, "tp_good", lambda register: register(good)), "offload_core"),
        EntryPoint("missing", "tp_no_such_module_anywhere", "offload_core"),
        EntryPoint("raising", _module(monkeypatch, "tp_raising", raising), "offload_core"),
        EntryPoint("junk", _module(monkeypatch, "tp_junk", lambda register: register(int)), "offload_core"),
        EntryPoint("abstract", _module(monkeypatch, "tp_abstract", lambda register: register(abstract)), "offload_core"),
        EntryPoint("dup", _module(monkeypatch, "tp_dup", lambda register: register(duplicate)), "offload_core"),
    ]
    monkeypatch.setattr("importlib.metadata.entry_points", lambda group: eps if group == "offload_core" else [])
    with caplog.at_level(logging.WARNING, logger="offload_core.device.plugins"):
        r = Registry()
    assert list(r.backends) == ["good"] and r.backends["good"].cls is good
    errors = {f.entry_point.split(" = ")[0]: f.error for f in r.failures}
    assert set(errors) == {"missing", "raising", "junk", "abstract", "dup"}
    assert errors["missing"].startswith("ModuleNotFoundError")
    assert errors["raising"] == "RuntimeError: hook exploded"
    assert "not a DeviceBackend subclass" in errors["junk"]
    assert "does not implement" in errors["abstract"]
    assert "already registered" in errors["dup"]
    assert caplog.text.count("skipped") == 5


@pytest.mark.skipif(Registry().info("cuda").available, reason="a CUDA device is available here")
def test_pytest_unavailable_backend_is_a_usage_error_with_its_reason():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--backend=cuda", "--pyargs", "offload_core.testing", "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 4, proc.stdout + proc.stderr
    assert "backend 'cuda' is not available here" in proc.stderr
