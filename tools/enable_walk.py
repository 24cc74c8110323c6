"""Where ``enable_offload``'s target goes: a static walk of the package, and how often it climbs.

Starting at ``offload_core.api.enable_offload`` with its ``target`` argument, the walk follows
every call that passes something made from the target (the target itself, a name assigned from an
expression that uses it, ``self.x`` set from one, a loop variable over one) to a function or class
of the package it can resolve statically: a name defined or imported in the caller's module, a
function of an imported module (``changes.register``), a method of the caller's own class
(``self.m``) or of a named class (``Cls.m``). Calls on other objects (``part.enable(txn)``) are not
followed. Each function reached is a *stay*; a call from a module to one in a higher layer (see
``LAYERS``, the layer diagram of docs/design.md) is a *climb*.

    python tools/enable_walk.py                 # this checkout's offload_core/
    python tools/enable_walk.py --root DIR      # another copy of the package (an older commit)

It prints the stays per module, every climb, and the call sites of each function of a ``FACTS`` module
that reads the target (a fact asked again instead of handed down shows as two sites);
``--max-climbs N`` makes it exit 1 above N.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import sys
from collections import defaultdict
from typing import NamedTuple

#: the layer diagram of docs/design.md, top (0) to bottom: a module may call into its own layer
#: and the ones below. Matched by longest prefix. backend/accelerator/hookspecs are the import
#: paths plugins written for 0.1 use (re-exports of device/). The flat names below the folders
#: (enable, handle, pipelines, errors, ...; ownership/foreign, plugins/dist/memory_accounting)
#: are where older trees kept those modules, so that an older commit can be walked with the
#: same table.
LAYERS = {
    "api": 0, "pretrained": 0,
    "enabling": 1,
    "handle": 2,
    "interop": 3,
    "strategies": 4,
    "discovery": 5, "hostmem": 5, "weights": 5, "planning": 5,
    "common": 6,
    "device": 7, "base": 7, "backend": 7, "accelerator": 7, "hookspecs": 7,
    # older trees
    "pretrained_transformers": 0, "model_folder": 0, "enable": 1, "fitting": 1, "installs": 2,
    "pipelines": 3, "other_hooks": 3, "casting": 3, "foreign": 3,
    "changes": 6, "ownership": 6, "config": 6, "timeline": 6, "labels": 6, "overlap": 6, "transaction": 6,
    "errors": 7, "locks": 7, "plugins": 7, "dist": 7, "memory_accounting": 7,
}
START = ("api", "enable_offload", "target")
#: the module that reads what a target is (a pipeline or not, its components and their kinds):
#: its path now, and the flat one of trees before the layer folders (for ``--root`` on those)
FACTS = ("discovery.pipelines", "pipelines")
ROOT = pathlib.Path(__file__).resolve().parents[1] / "offload_core"


def layer(module: str) -> int | None:
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return LAYERS[".".join(parts[:n])]
    return None


class Package:
    """The package's modules, their functions and classes, and what each module's names refer to."""

    def __init__(self, root: pathlib.Path) -> None:
        self.trees: dict[str, ast.Module] = {}
        for path in sorted(root.rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            self.trees[name] = ast.parse(path.read_text(), str(path))
        self.defs: dict[str, dict[str, ast.AST]] = {m: {} for m in self.trees}
        self.imports: dict[str, dict[str, tuple[str, str | None]]] = {m: {} for m in self.trees}
        for module, tree in self.trees.items():
            for node in tree.body:
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    self.defs[module][node.name] = node
            package = module if self._is_package(root, module) else module.rpartition(".")[0]
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = package.split(".") if package else []
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                    for alias in node.names:
                        sub = f"{target}.{alias.name}".lstrip(".")
                        local = alias.asname or alias.name
                        if sub in self.trees:
                            self.imports[module][local] = (sub, None)
                        elif target in self.trees:
                            self.imports[module][local] = (target, alias.name)

    @staticmethod
    def _is_package(root: pathlib.Path, module: str) -> bool:
        return (root / module.replace(".", "/") / "__init__.py").exists() if module else True

    def symbol(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        """The function or class ``name`` means in ``module`` (through re-exports)."""
        if name in self.defs.get(module, {}):
            return module, self.defs[module][name]
        found = self.imports.get(module, {}).get(name)
        if found is None or found[1] is None or depth > 8:
            return None
        return self.symbol(found[0], found[1], depth + 1)

    def method(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> tuple[str, ast.AST] | None:
        for node in cls.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                return module, node
        for base in cls.bases:
            if isinstance(base, ast.Name) and depth < 8:
                found = self.symbol(module, base.id)
                if found is not None and isinstance(found[1], ast.ClassDef):
                    hit = self.method(found[0], found[1], name, depth + 1)
                    if hit is not None:
                        return hit
        return None


def dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        inner = dotted(node.value)
        return None if inner is None else f"{inner}.{node.attr}"
    return None


def uses(expr: ast.AST, tainted: set[str]) -> bool:
    """Whether ``expr`` reads a name made from the target."""
    for node in ast.walk(expr):
        name = dotted(node) if isinstance(node, (ast.Name, ast.Attribute)) else None
        if name is not None:
            parts = name.split(".")
            if any(".".join(parts[:n]) in tainted for n in range(1, len(parts) + 1)):
                return True
    return False


def bound_names(target: ast.AST) -> list[str]:
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for element in target.elts for n in bound_names(element)]
    if isinstance(target, ast.Starred):
        return bound_names(target.value)
    name = dotted(target)
    return [name] if name is not None else []


def spread(func: ast.AST, tainted: set[str]) -> set[str]:
    """The names a function derives from its tainted parameters, to a fixed point."""
    tainted = set(tainted)
    while True:
        before = len(tainted)
        for node in ast.walk(func):
            pairs: list[tuple[list[ast.AST], ast.AST]] = []
            if isinstance(node, ast.Assign):
                pairs.append((node.targets, node.value))
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                pairs.append(([node.target], node.value))
            elif isinstance(node, (ast.For, ast.comprehension)):
                pairs.append(([node.target], node.iter))
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                pairs.append(([node.optional_vars], node.context_expr))
            for targets, value in pairs:
                if uses(value, tainted):
                    for target in targets:
                        tainted.update(bound_names(target))
        if len(tainted) == before:
            return tainted


def parameters(func: ast.AST, skip_first: bool) -> tuple[list[str], set[str]]:
    args = func.args
    positional = [a.arg for a in (*args.posonlyargs, *args.args)]
    return (positional[1:] if skip_first else positional), {a.arg for a in (*args.args, *args.kwonlyargs)}


class Walk(NamedTuple):
    """``stays``: module -> the functions reached in it; ``climbs``: (caller module, caller,
    callee module, callee) of each call into a higher layer; ``asks``: "module.function" -> the
    call sites ("module.function:line") that pass it something made from the target."""

    stays: dict[str, set[str]]
    climbs: list[tuple[str, str, str, str]]
    asks: dict[str, set[str]]


def walk(pkg: Package) -> Walk:
    start_module, start_func, start_arg = START
    queue = [(start_module, pkg.defs[start_module][start_func], None, frozenset({start_arg}))]
    seen: dict[int, set[str]] = {}
    stays: dict[str, set[str]] = defaultdict(set)
    climbs: list[tuple[str, str, str, str]] = []
    asks: dict[str, set[str]] = defaultdict(set)
    while queue:
        module, func, cls, params = queue.pop()
        key = id(func)
        if params <= seen.get(key, set()):
            continue
        seen.setdefault(key, set()).update(params)
        here_name = f"{cls.name}.{func.name}" if cls is not None else func.name
        stays[module].add(here_name)
        tainted = spread(func, set(seen[key]))
        classes = known_classes(pkg, module, func)
        for call in (n for n in ast.walk(func) if isinstance(n, ast.Call)):
            given = [(i, a) for i, a in enumerate(call.args) if uses(a, tainted)]
            named = [k.arg for k in call.keywords if k.arg and uses(k.value, tainted)]
            receiver = isinstance(call.func, ast.Attribute) and dotted(call.func.value) != "self" and uses(
                call.func.value, tainted)
            if not given and not named and not receiver:
                continue
            found = resolve(pkg, module, cls, call.func, classes)
            for callee_module, callee, callee_cls, skip_first in [found] if found is not None else []:
                positional, keywords = parameters(callee, skip_first)
                received = {positional[i] for i, _ in given if i < len(positional)} | {k for k in named if k in keywords}
                if receiver and skip_first and callee.args.args:
                    received.add(callee.args.args[0].arg)  # the object made from the target is ``self``
                if not received:
                    continue
                callee_name = f"{callee_cls.name}.{callee.name}" if callee_cls is not None else callee.name
                asks[f"{callee_module}.{callee_name}"].add(f"{module}.{here_name}:{call.lineno}")
                here, there = layer(module), layer(callee_module)
                if here is not None and there is not None and there < here:
                    climbs.append((module, func.name, callee_module, callee.name))
                queue.append((callee_module, callee, callee_cls, frozenset(received)))
    return Walk(stays, climbs, asks)


def known_classes(pkg: Package, module: str, func: ast.AST) -> dict[str, tuple[str, ast.ClassDef]]:
    """The package class of each name in ``func`` whose class is written down: a parameter's
    annotation, ``x = Cls(...)``, or ``x = f(...)`` where ``f`` is annotated to return one."""

    def named(annotation: ast.AST | None, where: str) -> tuple[str, ast.ClassDef] | None:
        if annotation is None:
            return None
        if isinstance(annotation, ast.Constant) and isinstance(annotation.value, str):
            annotation = ast.parse(annotation.value, mode="eval").body
        for node in ast.walk(annotation):
            if isinstance(node, ast.Name):
                found = pkg.symbol(where, node.id)
                if found is not None and isinstance(found[1], ast.ClassDef):
                    return found
        return None

    classes = {}
    args = func.args
    for arg in (*args.posonlyargs, *args.args, *args.kwonlyargs):
        found = named(arg.annotation, module)
        if found is not None:
            classes[arg.arg] = found
    for node in ast.walk(func):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name) and isinstance(node.value.func, ast.Name):
            found = pkg.symbol(module, node.value.func.id)
            if found is not None and isinstance(found[1], ast.ClassDef):
                classes[node.targets[0].id] = found
            elif found is not None:
                returned = named(found[1].returns, found[0])
                if returned is not None:
                    classes[node.targets[0].id] = returned
    return classes


def resolve(pkg: Package, module: str, cls: ast.ClassDef | None, func: ast.AST, classes: dict | None = None):
    """(module, function, its class, whether its first parameter is bound) that ``func`` calls."""
    if isinstance(func, ast.Name):
        found = pkg.symbol(module, func.id)
        if found is None:
            return None
        where, node = found
        if isinstance(node, ast.ClassDef):
            init = pkg.method(where, node, "__init__")
            return None if init is None else (init[0], init[1], node, True)
        return where, node, None, False
    if not isinstance(func, ast.Attribute):
        return None
    owner = dotted(func.value)
    if owner == "self" and cls is not None:
        hit = pkg.method(module, cls, func.attr)
        return None if hit is None else (hit[0], hit[1], cls, True)
    if owner in (classes or {}):
        where, known = classes[owner]
        hit = pkg.method(where, known, func.attr)
        return None if hit is None else (hit[0], hit[1], known, True)
    if owner is not None and "." not in owner:
        imported = pkg.imports.get(module, {}).get(owner)
        if imported is not None and imported[1] is None:  # a module: its function or class
            return resolve(pkg, imported[0], None, ast.Name(id=func.attr))
        found = pkg.symbol(module, owner)
        if found is not None and isinstance(found[1], ast.ClassDef):
            hit = pkg.method(found[0], found[1], func.attr)
            return None if hit is None else (hit[0], hit[1], found[1], True)
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=pathlib.Path, default=ROOT)
    parser.add_argument("--max-climbs", type=int, default=None)
    args = parser.parse_args(argv)
    stays, climbs, asks = walk(Package(args.root))
    for module in sorted(stays):
        print(f"{module}: {', '.join(sorted(stays[module]))}")
    for caller_module, caller, callee_module, callee in climbs:
        print(f"climb: {caller_module}.{caller} -> {callee_module}.{callee}")
    for callee in sorted(asks):
        if callee.rpartition(".")[0] in FACTS:
            print(f"{callee} asked from {', '.join(sorted(asks[callee]))}")
    total = sum(len(v) for v in stays.values())
    print(f"{total} stays in {len(stays)} modules, {len(climbs)} climbs")
    return 1 if args.max_climbs is not None and len(climbs) > args.max_climbs else 0


if __name__ == "__main__":
    sys.exit(main())
