"""The package's modules and the library modules each imports, wherever in the file: read from
the source with ``ast``, nothing imported. Shared by the import-cycle and the layer tests."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "offload_core"


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(name: str, path: pathlib.Path, known: dict) -> set[str]:
    """The library modules ``name`` imports, wherever in the file (under ``TYPE_CHECKING`` too)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            submodules = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in known]
            found |= {t for t in submodules or [target] if t in known and t != name}
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in known and a.name != name}
    return found

