"""docs/cli.md's sample outputs are what the commands print today (the figures that depend on
timing masked): regenerate them with ``python -m offload_core.cli_run.sample``."""

from __future__ import annotations

import pytest

from offload_core.cli_run import sample

pytestmark = pytest.mark.quick


def test_the_sample_outputs_are_up_to_date():
    text = sample.DOC.read_text(encoding="utf-8")
    blocks = sample.MARKED.findall(text)
    assert len(blocks) >= 2, "the marked sample blocks of docs/cli.md were not found"
    assert sample.masked(sample.regenerate(text)) == sample.masked(text), (
        "docs/cli.md's sample outputs are stale: run `python -m offload_core.cli_run.sample`"
    )


def test_masking_hides_only_the_timed_rows():
    table = "steps        2\ncall         118.4 ms (prompt encoding)\ndevice peak  1.15 MiB"
    assert sample.masked(table) == "steps        2\ncall         # ms (prompt encoding)\ndevice peak  1.15 MiB"
