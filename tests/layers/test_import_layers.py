"""The package's modules import one another without a cycle (module-level, deferred and
``TYPE_CHECKING`` imports alike: a type named from a module is knowledge of it, and a circle
through annotations is still two modules that cannot be read apart): each layer can be read,
tested and changed below the ones that use it. Exceptions live in ``offload_core/base/errors.py``,
which imports nothing of the library, so raising one never needs a layer above."""

from __future__ import annotations

from import_graph import imports, modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycle():
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    assert cycles(graph) == []


def test_the_detector_sees_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_errors_imports_nothing_of_the_library():
    known = modules()
    assert imports("offload_core.base.errors", known["offload_core.base.errors"], known) == set()
