"""docs/architecture.md's table of parts matches the code: every package, folder and module it
names exists, and every folder of perdure's code appears in it. A move that forgets the
page, or a new folder nobody described, fails here."""

from __future__ import annotations

import re
from pathlib import Path

import perdure

ROOT = Path(perdure.__file__).parent.parent
PKG = ROOT / "perdure"
DOC = ROOT / "docs" / "architecture.md"
RUN_DIR_NAMES = frozenset({"events.d/", "metrics.d/"})
"""Folders of a run directory that the table names (not code)."""


def parts_table() -> list[tuple[str, str]]:
    """``(package cell, holds cell)`` of each row of the table under ``## Parts``."""
    text = DOC.read_text()
    section = text.split("\n## Parts\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0].startswith("`perdure"):
            rows.append((cells[0], cells[1]))
    return rows


def row_folder(cell: str) -> Path:
    """`perdure.a.b` (or `perdure.a` (modules)) as its folder or module path."""
    name = re.match(r"`(perdure(?:\.\w+)*)`", cell)
    assert name, f"a row of the table of parts does not start with a package: {cell!r}"
    return ROOT / name.group(1).replace(".", "/")


def named_paths(cell: str) -> list[str]:
    """The backticked module and folder names of a cell (`x.py`, `a/b.py`, `faults/`)."""
    out = []
    for token in re.findall(r"`([^`\s]+)`", cell):
        if token in RUN_DIR_NAMES:
            continue
        if token.endswith((".py", "/")) or ("/" in token and token.endswith((".md", ".json"))):
            out.append(token)
    return out


def resolve(token: str, base: Path) -> list[Path]:
    """Where ``token`` may lie: in the row's folder, or from perdure's folder or the repo's
    root (a row may name a sibling's module, `run_config/compose.py`)."""
    roots = [base if base.is_dir() else base.parent, PKG, ROOT]
    found: list[Path] = []
    for r in roots:
        found += [p for p in r.glob(token.rstrip("/")) if p.exists()]
        if found:
            break
    return found


def code_folders() -> list[Path]:
    """Every folder of perdure holding Python code (packages and namespace folders)."""
    return sorted(
        d for d in [PKG, *PKG.rglob("*")] if d.is_dir() and d.name != "__pycache__"
        and any(d.glob("*.py"))
    )  # fmt: skip


def test_every_package_and_module_the_table_of_parts_names_exists() -> None:
    missing = []
    for cell, holds in parts_table():
        base = row_folder(cell)
        if not (base.is_dir() or base.with_suffix(".py").is_file()):
            missing.append(cell)
            continue
        missing += [f"{cell}: {t}" for t in named_paths(holds) if not resolve(t, base)]
    assert missing == []


def test_every_folder_of_perdure_appears_in_the_table_of_parts() -> None:
    seen: set[Path] = set()
    for cell, holds in parts_table():
        base = row_folder(cell)
        seen.add(base)
        for token in named_paths(holds):
            for path in resolve(token, base):
                seen.update([path, *path.parents] if path.is_dir() else path.parents)
    unnamed = [str(d.relative_to(ROOT)) for d in code_folders() if d not in seen and d != PKG]
    assert unnamed == []
