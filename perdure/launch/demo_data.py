"""The demo's dataset: the standard library's own ``*.py`` files, built once.

Its own module, below both users: the preflight (which builds it where a run names it)
and the demo (``demo.py``, which runs through ``api.run``, itself preflighted).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

from rich.console import Console

DATASET = Path("runs/datasets/demo-stdlib")


def ensure_dataset(path: Path, console: Console, *, max_mb: float = 8.0) -> str:
    """Build the demo corpus (the stdlib's own *.py files) once; return its version id."""
    from perdure.data import Dataset, build_dataset

    if not (path / "manifest.json").exists():
        src = sysconfig.get_paths()["stdlib"]
        console.print(f"building dataset {path} from {src} (*.py, {max_mb:g} MB) ...")
        build_dataset([src], str(path), seq_len=128, part_mb=0.5, include="*.py", max_mb=max_mb)
    return Dataset.open(str(path)).version_id
