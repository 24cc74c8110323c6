"""No test module imports another test module, or itself by name: what test files share lives in
plain modules (``tests/helpers.py``, a feature folder's helpers, its ``conftest.py``). A test
module imported by another runs its module-level code twice under two names, ties the two files'
edits together, and hides from whoever renames or splits one that the other depends on it.

Read with ``ast`` from the source, nothing imported: imports at module level, inside functions
(the ranks' entry points of the spawned-process tests), ``importlib.import_module`` with a
constant name, and the scripts that tests keep in strings and run in a fresh interpreter. Every
Python file of the test paths is read (helpers and conftests too), since a helper that imports a
test module ties the files together just the same."""

from __future__ import annotations

import ast
import pathlib
import textwrap

REPO = pathlib.Path(__file__).resolve().parents[2]
#: pyproject.toml's testpaths
TEST_PATHS = [REPO / "tests", REPO / "offload_core" / "testing"]


def is_test_module(name: str) -> bool:
    """Whether the dotted module ``name`` is a test module (pytest's ``test_*.py``)."""
    return name.rsplit(".", 1)[-1].startswith("test_")


def scripts(tree: ast.AST) -> list[ast.Module]:
    """The Python source kept in string constants of ``tree`` (scripts run in a subprocess)."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "import" in node.value:
            try:
                found.append(ast.parse(textwrap.dedent(node.value)))
            except SyntaxError:
                continue
    return found


def imported_test_modules(source: str) -> set[str]:
    """The test modules that ``source`` imports, wherever in it and in the scripts it holds."""
    found = set()
    trees = [ast.parse(source)]
    while trees:
        tree = trees.pop()
        trees.extend(scripts(tree))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names if is_test_module(a.name)}
            elif isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if is_test_module(module):
                    found.add(module)
                found |= {f"{module}.{a.name}".lstrip(".") for a in node.names if is_test_module(a.name)}
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute | ast.Name)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
                and is_test_module(node.args[0].value)
            ):
                found.add(node.args[0].value)
    return found


def test_no_test_module_imports_a_test_module():
    files = sorted(p for root in TEST_PATHS for p in root.rglob("*.py"))
    assert any(p.name == "test_autograd_distributed.py" for p in files)  # the walk reaches the folders
    offenders = {
        str(path.relative_to(REPO)): sorted(names)
        for path in files
        if (names := imported_test_modules(path.read_text()))
    }
    assert offenders == {}, "move what these share into a plain module or the folder's conftest.py"


def test_the_check_sees_every_kind_of_import():
    # written with TEST_ so that this file's own strings import no test module
    source = '''
import TEST_a
from TEST_b import helper
from offload_core.testing import TEST_c, kit
from .TEST_d import x


def worker():
    from TEST_e import build


def load():
    return importlib.import_module("TEST_f")


SCRIPT = """
import sys
from TEST_g import main
"""
'''.replace("TEST_", "test_")
    assert imported_test_modules(source) == {
        "test_a", "test_b", "offload_core.testing.test_c", "test_d", "test_e", "test_f", "test_g"
    }
    plain = "import helpers\nfrom stacks import build_stack\nfrom offload_core.testing import kit\nx = 'import of test_a'\n"
    assert imported_test_modules(plain) == set()
