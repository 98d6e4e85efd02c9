"""Where the code of a run came from: the commit of the user's task and library versions.

The commit sha is taken with ``git`` from the directory that defines the training task, not
from perdure's own checkout: what a resumed run needs to know is whether *its* code
changed. Outside a git repository the sha is the explicit string ``unknown``, never a guess.
"""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

UNKNOWN = "unknown"
_GIT_TIMEOUT_S = 10.0


def _git(path: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(path), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


_PINNED: dict[Path, dict[str, Any]] = {}
"""Commits read once for this process and its forks (``pin_commit``), by directory."""


def pin_commit(module: str) -> None:
    """Read the commit of the tree holding ``module`` now and answer it from then on, in
    this process and every fork of it. A run's zygote pins its task's module once it has
    imported it: the workers it forks run the code imported then, so that is the commit
    their checkpoints must name (a commit made on disk later is not what they run), and
    each worker no longer pays three ``git`` calls (~0.2 s of CPU) at its start."""
    src = task_source(module)
    if src is not None:
        _PINNED[_directory(src)] = commit_info(src)


def _directory(path: str | Path) -> Path:
    p = Path(path).resolve()
    return p.parent if p.is_file() else p


def commit_info(path: str | Path) -> dict[str, Any]:
    """``{"sha", "dirty", "root"}`` of the git tree holding ``path`` (``unknown`` outside git);
    what ``pin_commit`` read, if it pinned that directory."""
    p = _directory(path)
    if p in _PINNED:
        return dict(_PINNED[p])
    sha = _git(p, "rev-parse", "HEAD")
    if sha is None:
        return {"sha": UNKNOWN, "dirty": None, "root": None}
    status = _git(p, "status", "--porcelain", "--untracked-files=no")
    root = _git(p, "rev-parse", "--show-toplevel")
    return {"sha": sha, "dirty": bool(status), "root": root}


def library_versions() -> dict[str, str]:
    """Versions of the libraries whose behaviour can change the bits of a run."""
    import numpy
    import torch

    from perdure import __version__

    return {
        "perdure": __version__,
        "torch": torch.__version__,
        "numpy": numpy.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def task_source(entry: str) -> Path | None:
    """The file that defines a ``module:function`` task entry, if it can be found."""
    import importlib.util

    module = entry.partition(":")[0]
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec and spec.origin else None


def provenance(entry: str) -> dict[str, Any]:
    """The checkpoint's commit-sha field: the task's commit plus library versions."""
    src = task_source(entry)
    info = commit_info(src) if src else {"sha": UNKNOWN, "dirty": None, "root": None}
    return {"task_entry": entry, **info, "versions": library_versions()}
