"""Resolve build sources (files, directories, globs) to a deterministic list of files.

Order: sources in the order given; inside a directory or a glob, files sorted by their
POSIX path relative to the source root, so the order (and hence the dataset) does not
depend on the machine, the file system's listing order or where the tree is mounted.
A file named twice is read once, at its first place.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from pathlib import Path

from perdure.data.errors import DataError

_GLOB_CHARS = set("*?[")


def list_sources(sources: list[str], include: str = "*") -> list[Path]:
    """Files of ``sources``; ``include`` is an fnmatch pattern on names inside directories.

    Raises :class:`DataError` naming a source that matches no file.
    """
    if not sources:
        raise DataError("build: sources must not be empty (got [])")
    seen: set[Path] = set()
    out: list[Path] = []
    for src in sources:
        files = _expand(src, include)
        if not files:
            raise DataError(f"build: source {src!r} matches no file (include={include!r})")
        for f in files:
            key = f.resolve()
            if key not in seen:
                seen.add(key)
                out.append(f)
    return out


def _expand(src: str, include: str) -> list[Path]:
    if any(c in _GLOB_CHARS for c in src):
        hits = [Path(h) for h in glob.glob(src, recursive=True)]
        return sorted((h for h in hits if h.is_file()), key=lambda p: p.as_posix())
    path = Path(src)
    if path.is_file():
        return [path]
    if path.is_dir():
        return _walk(path, include)
    return []


def _walk(root: Path, include: str) -> list[Path]:
    found: list[tuple[str, Path]] = []
    for dirpath, _dirs, names in os.walk(root):
        for name in names:
            if fnmatch.fnmatchcase(name, include):
                full = Path(dirpath) / name
                if full.is_file():
                    found.append((full.relative_to(root).as_posix(), full))
    return [p for _, p in sorted(found)]
