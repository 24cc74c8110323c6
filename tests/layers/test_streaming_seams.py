"""The streaming part's seams, read from the source: the transport and its rank pairing are
protocols of at most six verbs each and the part calls nothing else on them, the transport is
handed a frozen context of at most six members and uses only those, it never writes the part's weight units (the home
policy does), the ring's slots are read only in the ring's module, and no class grows past 350
lines. Each check is also run on a source that breaks it, so that it is seen to fail."""

from __future__ import annotations

import ast
import dataclasses
import pathlib

import offload_core
from offload_core.strategies.transport import LoadContext, RankPairing, Transport

PACKAGE = pathlib.Path(offload_core.__file__).parent
TRANSPORTS = [PACKAGE / "strategies" / "transport.py", PACKAGE / "strategies" / "gather.py"]
#: the modules of the part that call its transport and its pairing
CALLERS = [PACKAGE / "strategies" / name for name in ("layerwise.py", "loader.py", "passes.py", "distributed.py")]
#: what a unit's home is changed through: the home policy's verbs, never a transport's
UNIT_WRITES = {"bind", "pack", "take", "keep_on", "unpack", "spill"}


def _context_reads(source: str) -> set[str]:
    """The members read of the context a transport keeps (``self.at``, or a local ``at`` bound to it)."""
    reads = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Name) and owner.id == "at") or (
                    isinstance(owner, ast.Attribute) and owner.attr == "at"
                    and isinstance(owner.value, ast.Name) and owner.value.id == "self"):
                reads.add(node.attr)
        if isinstance(node, ast.FunctionDef) and node.name == "serve":
            reads |= {n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)
                      and isinstance(n.value, ast.Name) and n.value.id == "context"}
    return reads


def _members(protocol) -> tuple[set[str], set[str]]:
    """(verbs, attributes) a protocol declares."""
    verbs = {n for n, v in vars(protocol).items() if callable(v) and not n.startswith("_")}
    return verbs, set(protocol.__annotations__)


def _calls_on(source: str, name: str) -> set[str]:
    """The members used of an object the source names ``name`` (``x.name.member``, ``name.member``)."""
    used = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute):
            owner = node.value
            if (isinstance(owner, ast.Attribute) and owner.attr == name) or (
                    isinstance(owner, ast.Name) and owner.id == name):
                used.add(node.attr)
    return used


def _unit_writes(source: str) -> list[str]:
    """Attributes a module assigns on anything but ``self``, and the home verbs it calls."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for t in ast.walk(target):
                if isinstance(t, ast.Attribute) and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                    found.append(f"line {t.lineno}: assigns .{t.attr}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in UNIT_WRITES:
            found.append(f"line {node.lineno}: calls .{node.func.attr}()")
    return found


def _long_classes(source: str, limit: int = 350) -> list[str]:
    return [f"{n.name}: {n.end_lineno - n.lineno + 1} lines" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.ClassDef) and n.end_lineno - n.lineno + 1 > limit]


def test_the_transport_and_its_pairing_are_narrow_and_the_part_calls_nothing_else_on_them():
    for protocol, name in ((Transport, "transport"), (RankPairing, "pairing")):
        verbs, attributes = _members(protocol)
        assert 0 < len(verbs) <= 6, f"{protocol.__name__}: {sorted(verbs)}"
        for path in CALLERS:
            used = _calls_on(path.read_text(), name)
            assert used <= verbs | attributes, (
                f"{path.name} uses {sorted(used - verbs - attributes)} of the {name}, which its protocol does not list")


def test_the_transport_context_is_frozen_and_a_transport_uses_only_its_members():
    fields = {f.name for f in dataclasses.fields(LoadContext)}
    assert len(fields) <= 6 and LoadContext.__dataclass_params__.frozen
    for path in TRANSPORTS:
        reads = _context_reads(path.read_text())
        assert reads <= fields, f"{path.name} reads {sorted(reads - fields)} of its context, which has no such member"
        assert len(reads) <= 6


def test_no_transport_writes_a_weight_unit():
    for path in TRANSPORTS:
        assert _unit_writes(path.read_text()) == [], path.name


def test_the_ring_slots_are_read_in_the_ring_module_only():
    for path in PACKAGE.rglob("*.py"):
        if path.name != "ring.py":
            assert "._slots" not in path.read_text(), path


def test_no_class_in_the_library_is_over_350_lines():
    long = {str(p.relative_to(PACKAGE)): _long_classes(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert {p: c for p, c in long.items() if c} == {}


def test_the_checks_see_what_they_look_for():
    assert _context_reads("class T:\n    def issue(self):\n        at = self.at\n        at.units[0]\n") == {"units"}
    assert _context_reads("class T:\n    def serve(self, context):\n        self.x = context.model\n") == {"model"}
    assert _unit_writes("def f(unit, b):\n    unit.host = b\n") == ["line 2: assigns .host"]
    assert _unit_writes("def f(unit):\n    unit.bind(unit.host_views)\n") == ["line 2: calls .bind()"]
    assert _unit_writes("class T:\n    def f(self):\n        self.x = 1\n") == []
    assert _long_classes("class C:\n" + "    x = 1\n" * 350) == ["C: 351 lines"]
    assert _calls_on("def f(part):\n    part.transport.allocate()\n", "transport") == {"allocate"}
    assert _calls_on("def f(pairing):\n    pairing.finish(True)\n", "pairing") == {"finish"}
