"""No import circle inside any folder of perdure (issue 37): within a package, its modules
and subpackages form layers, so each can be read and tested from the bottom up.

``test_layering.py`` checks the packages against each other; this checks inside each
one. Every import counts, a lazy one inside a function too (a lazy import that closes a
circle only hides it: the two modules still cannot be understood alone), except those
under ``if TYPE_CHECKING:``, which never run.
"""

from __future__ import annotations

import ast
from pathlib import Path

import perdure
from tests.unit.test_layering import _cycle as circle  # the one cycle finder

PKG = Path(perdure.__file__).parent


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, package: str) -> list[str]:
    """Every module name ``tree`` imports (``from a import b`` gives ``a`` and ``a.b``),
    relative imports resolved against ``package``, ``TYPE_CHECKING`` blocks skipped."""
    out: list[str] = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            out += [n for s in node.orelse for n in _imports(ast.Module([s], []), package)]
            continue
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = ".".join([*base, node.module or ""]).strip(".") if node.level else node.module
            out += [module or ""] + [f"{module}.{a.name}" for a in node.names]
        out += _imports(node, package)
    return out


def folder_graphs(root: Path = PKG) -> dict[str, dict[str, set[str]]]:
    """For each package folder under ``root``: its units (modules and subpackages directly
    in it) -> the units of the same folder that anything in them imports."""
    parsed: dict[Path, list[str]] = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        package = ".".join(rel.parts[:-1])  # the package a relative import starts from
        parsed[path] = _imports(ast.parse(path.read_text()), package)
    graphs: dict[str, dict[str, set[str]]] = {}
    for init in root.rglob("__init__.py"):
        folder = init.parent
        name = ".".join(folder.relative_to(root.parent).parts)
        graph = graphs.setdefault(name, {})
        for path, names in parsed.items():
            if folder not in path.parents or path == init:
                continue
            unit = path.relative_to(folder).parts[0].removesuffix(".py")
            edges = graph.setdefault(unit, set())
            for imported in names:
                if not imported.startswith(name + "."):
                    continue
                first = imported[len(name) + 1 :].split(".")[0]
                if first != unit and (
                    (folder / f"{first}.py").is_file() or (folder / first / "__init__.py").is_file()
                ):
                    edges.add(first)
    return graphs


def test_no_folder_of_perdure_has_an_import_circle() -> None:
    graphs = folder_graphs()
    assert {"perdure", "perdure.runtime.control", "perdure.checkpoint"} <= set(graphs)
    found = {name: c for name, g in sorted(graphs.items()) if (c := circle(g)) is not None}
    assert found == {}


def test_the_finder_sees_lazy_and_relative_imports_and_skips_type_checking(
    tmp_path: Path,
) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from .sub import c\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    graphs = folder_graphs(pkg)
    assert graphs["pkg"] == {"a": {"b"}, "b": {"sub"}, "sub": {"a"}, "d": set()}
    assert circle(graphs["pkg"]) == ["a", "b", "sub", "a"]
    assert circle({"a": {"b"}, "b": set()}) is None
