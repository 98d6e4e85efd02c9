"""perdure's subpackages form layers: no import cycle between them, lazy imports included.

A cycle between packages means neither can be understood, tested or replaced alone; the
layering is what lets a reducer, a launcher or a fault kind plug in as one new file.
"""

from __future__ import annotations

import ast
from pathlib import Path

import perdure

PKG = Path(perdure.__file__).parent
SPLIT = {"runtime"}
"""Packages that are not one layer: each of their subpackages, and each module directly
in them, is a unit of its own (``runtime.control``, ``runtime.worker``)."""


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "perdure" or len(parts) < 2:
        return None
    if parts[1] in SPLIT and len(parts) > 2:
        return ".".join(parts[1:3])
    return parts[1]


def _exists(unit: str) -> bool:
    path = PKG / unit.replace(".", "/")
    return path.is_dir() or path.with_suffix(".py").is_file()


def _module_of(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        src = _unit(_module_of(path))
        if src is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            for name in names:
                dst = _unit(name)
                if dst is not None and dst != src and _exists(dst):
                    graph.setdefault(src, set()).add(dst)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return [*stack[stack.index(m) :], m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def test_no_import_cycle_between_subpackages() -> None:
    assert _cycle(import_graph()) is None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}}) is None
