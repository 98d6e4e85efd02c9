"""The control plane stays split by concern (issue 37): no file under
``perdure/runtime/control/`` over 450 lines, no class in it with over 25 methods."""

from __future__ import annotations

import ast
from pathlib import Path

CONTROL = Path(__file__).resolve().parents[2] / "perdure" / "runtime" / "control"
MAX_LINES = 450
MAX_METHODS = 25


def _methods(tree: ast.Module) -> dict[str, int]:
    """Every class (nested ones too) -> how many functions its body defines (properties,
    setters and static methods count)."""
    return {
        node.name: sum(
            isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) for item in node.body
        )
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }


def test_no_file_of_the_control_plane_is_over_450_lines() -> None:
    files = sorted(CONTROL.glob("*.py"))
    assert len(files) > 10  # the folder is where this test thinks it is
    long = {f.name: n for f in files if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_class_of_the_control_plane_has_over_25_methods() -> None:
    counts = {
        f"{f.name}:{name}": n
        for f in sorted(CONTROL.glob("*.py"))
        for name, n in _methods(ast.parse(f.read_text())).items()
    }
    assert "policy.py:Policy" in counts
    assert {k: n for k, n in counts.items() if n > MAX_METHODS} == {}


def test_the_counter_sees_methods_properties_and_nested_classes() -> None:
    """The measure itself: a class of 26 functions (one a property) is caught."""
    body = "\n".join(f"    def m{i}(self): ..." for i in range(25))
    tree = ast.parse(f"class Big:\n    @property\n    def p(self): ...\n{body}\n")
    assert _methods(tree) == {"Big": 26}
