"""The conformance kit must fail backends that break the ordering contract.

A kit that passes everything proves nothing. Here two deliberately broken backends, installed as a
real plugin distribution (entry point group ``offload_core``), are run through
``pytest --backend=NAME --pyargs offload_core.testing`` exactly as a vendor would run it:

* ``broken``: event ``wait`` does nothing (so ``wait_stream`` orders nothing either);
* ``liar``: ``copy_async`` ignores the stream it is given, and events claim to be reached at once.

The kit passing the correct fake backend is covered by the main suite (``testpaths`` includes the
kit) and by ``test_third_party_plugin.py`` for an installed third-party backend.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from plugin_dists import outcomes, pip_install, plugin_env, write_project

MODULE = '''\
"""Backends that break the DeviceBackend contract on purpose."""

from offload_core import hookimpl
from offload_core_fake import FakeBackend
from offload_core_fake.streams import FakeEvent


class NoWaitEvent(FakeEvent):
    def wait(self, stream=None):
        pass  # BUG: enqueues no wait


class BrokenBackend(FakeBackend):
    """Event waits (and so wait_stream) order nothing."""

    name = "broken"
    priority = -1  # never picked by auto-detection

    def new_event(self):
        return NoWaitEvent(self.current_stream, self.timeline)


class LyingEvent(FakeEvent):
    def query(self):
        return True  # BUG: claims to be reached

    def synchronize(self):
        pass  # BUG: does not block


class LiarBackend(FakeBackend):
    """copy_async runs on a private stream whatever stream it is given; events lie."""

    name = "liar"
    priority = -1

    def copy_async(self, dst, src, stream=None):
        if not hasattr(self, "_elsewhere"):
            self._elsewhere = self.new_stream()
        super().copy_async(dst, src, self._elsewhere)  # BUG: ignores ``stream``

    def new_event(self):
        return LyingEvent(self.current_stream, self.timeline)


@hookimpl
def offload_core_register_backends(register):
    register(BrokenBackend)
    register(LiarBackend)
'''

# Tests that must fail for each broken backend: the orderings it breaks.
MUST_FAIL = {
    "broken": {
        "test_events.py::test_event_orders_a_consumer_after_a_producer",
        "test_events.py::test_events_protect_reused_slots",
        "test_events.py::test_event_wait_orders_compute_on_the_current_stream",
        "test_events.py::test_an_overwrite_waits_for_an_earlier_read_on_another_stream",
        "test_streams.py::test_wait_stream_orders_a_consumer_after_a_producer",
        "test_streams.py::test_wait_stream_orders_compute_on_the_current_stream",
        "test_collectives.py::test_all_gather_on_a_side_stream_across_two_ranks",
    },
    "liar": {
        "test_streams.py::test_stream_runs_work_in_fifo_order",
        "test_streams.py::test_use_stream_selects_and_restores_the_current_stream",
        "test_events.py::test_query_is_false_until_synchronize_returns",
        "test_transfers.py::test_round_trip_is_exact[3x5-float32]",
    },
}
# Tests that do not depend on the broken parts and must still pass (the kit is specific).
MUST_PASS = {
    "broken": {"test_streams.py::test_stream_runs_work_in_fifo_order", "test_memory.py::test_empty_pinned_is_pinned"},
    "liar": {"test_memory.py::test_capacity_raises_out_of_memory"},
}


@pytest.fixture(scope="module")
def kit_runs(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """Install the broken plugin once, then run the kit for both broken backends in parallel."""
    root = tmp_path_factory.mktemp("broken-offload")
    project = write_project(root / "project", "broken-offload", "broken", "broken_offload", MODULE)
    site = root / "site"
    pip_install(site, project)
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "pytest", f"--backend={name}", "--pyargs", "offload_core.testing"]
            + ["-q", "-rA", "-p", "no:cacheprovider", "-p", "no:randomly"],
            cwd=root,
            env=plugin_env(site),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name in MUST_FAIL
    }
    runs = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        runs[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out)
    return runs


@pytest.mark.parametrize("name", sorted(MUST_FAIL))
def test_kit_fails_a_broken_backend(kit_runs, name):
    run = kit_runs[name]
    tail = textwrap.indent(run.stdout[-6000:], "  ")
    assert run.returncode == 1, f"the kit did not fail backend {name!r} (exit {run.returncode}):\n{tail}"
    passed, failed = outcomes(run.stdout)
    missed = MUST_FAIL[name] - failed
    assert not missed, f"backend {name!r} passed ordering tests it breaks: {sorted(missed)}\n{tail}"
    wrongly = MUST_PASS[name] - passed
    assert not wrongly, f"backend {name!r} failed tests it does not break: {sorted(wrongly)}\n{tail}"
