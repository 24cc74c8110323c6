"""Plugins are other people's code in every process that imports offload_core: whatever they do
(exit at import or in probe(), register bad or taken names, claim an in-tree name, use the registry
while it is being built), it is reported and the listing and auto-detection still work; and each
backend is probed once per process.

The plugins are real throwaway distributions (a module and its ``.dist-info`` with the entry
point, as an installer leaves them) in a folder that only the subprocesses see (their
``PYTHONPATH``); ``tests/test_third_party_plugin.py`` installs one with pip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from plugin_dists import plugin_env, write_installed

from offload_core.device.plugins import ENV_BACKEND

#: distribution -> (entry point name, module, source)
PLUGINS = {
    "acme-exits": ("exits", "acme_exits", "raise SystemExit(3)\n"),
    "acme-probe-exits": ("probe_exits", "acme_probe_exits", '''
import sys
from offload_core import hookimpl
from offload_core_fake import FakeBackend

class ProbeExits(FakeBackend):
    name = "probe-exits"
    is_accelerator = True
    @classmethod
    def probe(cls):
        sys.exit("no device here")
    @classmethod
    def unavailable_reason(cls):
        raise SystemExit(4)

@hookimpl
def offload_core_register_backends(register):
    register(ProbeExits)
'''),
    "acme-hook-exits": ("hook_exits", "acme_hook_exits", '''
from offload_core import hookimpl

@hookimpl
def offload_core_register_backends(register):
    raise SystemExit(5)
'''),
    "acme-bad-names": ("bad_names", "acme_bad_names", '''
from offload_core import hookimpl
from offload_core_fake import FakeBackend

class Nameless(FakeBackend):
    name = None

class Spaced(FakeBackend):
    name = "has space"

class Twin(FakeBackend):
    name = "twin"

class OtherTwin(FakeBackend):
    name = "twin"

@hookimpl
def offload_core_register_backends(register):
    for cls in (Nameless, Spaced, Twin, OtherTwin):
        register(cls)
'''),
    "acme-shadow": ("fake", "acme_shadow", '''
from offload_core import hookimpl
from offload_core_fake import FakeBackend

class ShadowFake(FakeBackend):
    name = "fake"
    is_accelerator = True
    priority = 99

@hookimpl
def offload_core_register_backends(register):
    register(ShadowFake)
'''),
    "acme-reentrant": ("reentrant", "acme_reentrant", '''
import offload_core
from offload_core import hookimpl
from offload_core_fake import FakeBackend

offload_core.get_backend()  # at import time, while the registry is loading this very plugin

class Reentrant(FakeBackend):
    name = "reentrant"

@hookimpl
def offload_core_register_backends(register):
    register(Reentrant)
'''),
    "acme-counted": ("counted", "acme_counted", '''
import os
from offload_core import hookimpl
from offload_core_fake import FakeBackend

def _count(what):
    with open(os.environ["ACME_PROBE_LOG"], "a") as log:
        log.write(what + "\\n")

class Counted(FakeBackend):
    name = "counted"
    is_accelerator = True
    @classmethod
    def probe(cls):
        _count("probe")
        return False
    @classmethod
    def unavailable_reason(cls):
        _count("reason")
        return "no counted device"

@hookimpl
def offload_core_register_backends(register):
    register(Counted)
'''),
}

CHECK = r"""
import json, offload_core
from offload_core.device.plugins import registry
chosen = offload_core.get_backend()
fake = offload_core.get_backend("fake")
print("CHECK " + json.dumps({
    "chosen": chosen.name, "fake_class": type(fake).__module__ + "." + type(fake).__name__,
    "listed": [b.name for b in offload_core.list_backends()],
}))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    target = tmp_path_factory.mktemp("hostile") / "site"
    for dist, (entry, module, source) in PLUGINS.items():
        write_installed(target, dist, entry, module, source)
    return target


def _run(site: Path, argv: list[str], tmp_path: Path) -> tuple[subprocess.CompletedProcess, list[str]]:
    log = tmp_path / "probes.log"
    log.write_text("")
    env = {**plugin_env(site), "ACME_PROBE_LOG": str(log)}
    env.pop(ENV_BACKEND, None)
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180)
    return proc, log.read_text().split()


@pytest.fixture(scope="module")
def listing(site, tmp_path_factory):
    script = Path(sys.executable).with_name("offload-core")
    return _run(site, [str(script), "backends", "--json"], tmp_path_factory.mktemp("listing"))


def test_the_listing_survives_every_plugin_and_reports_each(listing):
    proc, _ = listing
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    failures = {f["source"]: f["error"] for f in report["failures"]}
    assert failures["acme-exits"] == "SystemExit: 3"
    assert failures["acme-hook-exits"] == "SystemExit: 5"
    assert "offload_core's backend registry was used while its plugins were being loaded" in failures["acme-reentrant"]
    assert "the in-tree backend's; a plugin cannot replace it" in failures["acme-shadow"]
    bad = [f["error"] for f in report["failures"] if f["source"] == "acme-bad-names"]
    assert any("Nameless has an invalid name None" in e for e in bad)
    assert any("Spaced has an invalid name 'has space'" in e for e in bad)
    assert any("backend name 'twin' is already registered by acme-bad-names" in e for e in bad)
    rows = {b["name"]: b for b in report["backends"]}
    assert rows["fake"]["source"] == "offload-core" and rows["twin"]["source"] == "acme-bad-names"
    assert rows["probe-exits"]["available"] is False
    assert rows["probe-exits"]["reason"] == "unavailable_reason() raised SystemExit: 4"
    assert "reentrant" not in rows and None not in rows
    assert report["auto"]["name"] not in ("probe-exits", "counted")


def test_each_probe_runs_once_per_process(listing):
    _, probes = listing
    assert probes.count("probe") == 1 and probes.count("reason") == 1, probes


def test_selection_still_works_and_the_in_tree_fake_is_the_fake(site, tmp_path):
    proc, probes = _run(site, [sys.executable, "-c", CHECK], tmp_path)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("CHECK "))[6:])
    assert result["fake_class"] == "offload_core_fake.backend.FakeBackend"
    assert result["chosen"] not in ("probe-exits", "counted") and "probe-exits" in result["listed"]
    assert probes.count("probe") == 1
