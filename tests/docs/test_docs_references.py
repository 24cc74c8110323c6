"""The repository refers only to itself: no section numbers of a design file it does not contain,
no path outside it, and every relative link in the docs names a file that exists."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SKIP = {".git", ".venv", "build", "__pycache__"}
OUTSIDE = re.compile(r"DESIGN(\.md| ?§| section)|\.\./shared")


def _text_files():
    for folder, subfolders, files in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if d not in SKIP and not d.endswith(".egg-info")]
        for name in files:
            if name.endswith((".py", ".md", ".toml", ".sh", ".txt")):
                yield Path(folder) / name


def test_nothing_refers_to_files_outside_the_repository():
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _text_files() if path != Path(__file__).resolve()
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert not found, "\n".join(found)


def _anchors(doc: Path) -> set[str]:
    """The heading anchors of a markdown file, slugged as GitHub does."""
    headings = re.findall(r"^#+ (.+)$", doc.read_text(encoding="utf-8"), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_relative_links_in_the_docs_resolve():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target, anchor in re.findall(r"\]\(([^)#\s]*)(?:#([^)\s]*))?\)", doc.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            path = doc.parent / target if target else doc
            if not path.exists() or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
                broken.append(f"{doc.relative_to(ROOT)} -> {target}#{anchor}")
    assert not broken, broken
