"""docs/float8.md: its table of what float8 storage changes in the tiny pipelines' outputs is the
one ``tools/float8_loss.py`` measures now."""

from __future__ import annotations

import pytest

from tools.float8_loss import DOC, MARKED, render

pytestmark = pytest.mark.fake_only("the figures are the CPU's")


def test_the_loss_table_is_current():
    text = DOC.read_text(encoding="utf-8")
    assert MARKED.search(text), "docs/float8.md lost its table markers"
    assert render(text) == text, "docs/float8.md is stale: run `python tools/float8_loss.py`"
