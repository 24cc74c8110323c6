"""docs/benchmarks.md's tables hold figures, not their history: no cell runs over 300 characters
(a history belongs in the commit that changed the figure, or in one short paragraph per section)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

PAGES = [Path(__file__).resolve().parents[2] / "docs" / "benchmarks.md"]
MAX_CELL = 300


def test_no_table_cell_is_a_history():
    long = [f"{page.name}:{number}: {len(cell)} characters: {cell[:60]}..."
            for page in PAGES
            for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1) if line.startswith("|")
            for cell in (c.strip() for c in line.strip().strip("|").split("|")) if len(cell) > MAX_CELL]
    assert not long, "\n".join(long)
