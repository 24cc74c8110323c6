"""The layer diagram of docs/design.md is the package's top level: every module and folder it
names exists and has the layer the diagram gives it in the table the layer tests use
(``LAYERS`` in tools/enable_walk.py), and nothing at the top of ``offload_core/`` is missing
from it, so a module added at the top, or moved without the diagram, fails here; and every
folder of the package is one the wheel holds."""

from __future__ import annotations

import pathlib
import re

from tools import enable_walk

ROOT = pathlib.Path(__file__).resolve().parents[2]
#: beside the library (docs/design.md, "in offload_core/, beside the library")
BESIDE = {"cli", "bench", "tiny", "testing", "__main__", "__init__"}
ENTRY = re.compile(r"^(?:layer (\d)  |         )((?:[a-z_]+(?:/|\.py))(?:, [a-z_]+(?:/|\.py))*)")


def diagram(text: str) -> dict[str, int]:
    """name (``planning`` for ``planning/``, ``api`` for ``api.py``) -> layer, from the diagram."""
    block = text.split("## Layers", 1)[1].split("```")[1].split("in offload_core/, beside the library:")[0]
    found: dict[str, int] = {}
    layer = None
    for line in block.splitlines():
        match = ENTRY.match(line)
        if match is None:
            continue
        layer = int(match.group(1)) if match.group(1) else layer
        for name in match.group(2).split(", "):
            found[name.removesuffix("/").removesuffix(".py")] = layer
    return found


def top_level() -> set[str]:
    package = ROOT / "offload_core"
    names = {p.stem for p in package.glob("*.py")}
    names |= {p.name for p in package.iterdir() if (p / "__init__.py").exists()}
    return names - BESIDE


def test_the_diagram_is_the_top_level_and_the_layer_table():
    drawn = diagram((ROOT / "docs" / "design.md").read_text())
    assert drawn.keys() == top_level()
    assert {name: enable_walk.layer(name) for name in drawn} == drawn


def test_the_diagram_reader_sees_entries_and_layers():
    text = "## Layers\n\n```\nlayer 0  api.py    x\n         pretrained/  y\n                 z.py, not an entry\n" \
           "layer 7  device/   w\n         backend.py, hookspecs.py: v\n\nin offload_core/, beside the library:\n```\n"
    assert diagram(text) == {"api": 0, "pretrained": 0, "device": 7, "backend": 7, "hookspecs": 7}


def test_the_wheel_lists_every_package():
    """pyproject.toml names the packages a wheel holds one by one: a folder of the library missing
    there imports in a checkout (and in this suite) but not where the wheel is installed."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    package = ROOT / "offload_core"
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in package.rglob("__init__.py")}
    assert folders <= listed, sorted(folders - listed)
