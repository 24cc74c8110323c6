"""docs/cli.md's and README.md's sample outputs are what the commands print today (the figures
that depend on timing masked, with their units), on an idle machine or a loaded one; regenerate
them with ``python tools/cli_samples.py`` on an idle machine (it refuses a busy one)."""

from __future__ import annotations

import time

import pytest

from tools import cli_samples as sample

pytestmark = pytest.mark.quick


def test_the_sample_outputs_are_up_to_date():
    for page in sample.PAGES:
        assert sample.MARKED.findall(page.read_text(encoding="utf-8")), f"no marked sample block in {page}"
    differences = [line for page in sample.PAGES for line in sample.stale(page)]
    assert not differences, (
        "the sample outputs differ from what the commands print now in more than timing (times are masked):\n"
        + "\n".join(differences)
        + "\nif the change is meant, run `python tools/cli_samples.py` on an idle machine (it refuses to "
        "write a busy machine's figures)"
    )


@pytest.fixture
def slow_clock(monkeypatch):
    """Every clock the run reads (the command's, the timeline's, the fake's) runs 40 times fast,
    so that each step of the demo takes well over a second, as on a very loaded machine."""
    import offload_core.common.timeline
    import offload_core_fake.streams
    import offload_core_fake.trace

    counter, counter_ns = time.perf_counter, time.perf_counter_ns
    start = counter_ns()

    def slow_ns() -> int:
        return start + (counter_ns() - start) * 40

    monkeypatch.setattr(time, "perf_counter", lambda: slow_ns() / 1e9)
    monkeypatch.setattr(time, "perf_counter_ns", slow_ns)
    for module in (offload_core.common.timeline, offload_core_fake.trace, offload_core_fake.streams):
        if getattr(module, "now_ns", None) is counter_ns:
            monkeypatch.setattr(module, "now_ns", slow_ns)
    del counter


def test_a_slow_machine_does_not_fail_the_comparison(slow_clock):
    """Calls over a second print "1.20 s" where the page says "54.8 ms": still the same sample."""
    printed = sample.output_of("offload-core run")
    assert "time per step" in printed and " s (median of steps" in printed  # the clock did slow down
    assert sample.stale(sample.DOC) == []


def test_masking_hides_the_timed_figures_with_their_units():
    table = ("steps        2\ncall         118.4 ms (prompt encoding)\ndevice peak  1.15 MiB\n"
             "verdict      copies 91% hidden (88% to 99% over steps 2-8); unreliable (machine busy): load 7")
    assert sample.masked(table) == ("steps        2\ncall         # (prompt encoding)\ndevice peak  1.15 MiB\n"
                                    "verdict      copies # hidden (# to # over steps #-#)")
    slow, fast = "call         1.20 s (prompt encoding)", "call         54.8 ms (prompt encoding)"
    assert sample.masked(slow) == sample.masked(fast)
