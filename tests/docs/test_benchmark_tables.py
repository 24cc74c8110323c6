"""The docs' tables hold figures and short facts, not their history or their reasons: no cell runs
over 300 characters (a history belongs in the commit that changed the figure, or in one short
paragraph per section; a reason in the prose under the table).

Two pages are left out: design.md, whose contract table states each guarantee in full in its
cells, and compatibility.md, which tools/compatibility.py writes (its rows are the tool's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.quick

DOCS = Path(__file__).resolve().parents[2] / "docs"
NOT_CHECKED = {"design.md", "compatibility.md"}
PAGES = [page for page in sorted(DOCS.glob("*.md")) if page.name not in NOT_CHECKED]
MAX_CELL = 300
CELL_BORDER = re.compile(r"(?<!\\)\|")


def _table_cells(page: Path):
    """(line number, cell) of every table row outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("|"):
            for cell in CELL_BORDER.split(line.strip().strip("|")):
                yield number, cell.strip()


def test_the_benchmarks_page_is_checked():
    assert DOCS / "benchmarks.md" in PAGES


def test_no_table_cell_is_a_history():
    long = [f"{page.name}:{number}: {len(cell)} characters: {cell[:60]}..."
            for page in PAGES for number, cell in _table_cells(page) if len(cell) > MAX_CELL]
    assert not long, "\n".join(long)
