"""Writing a dataset directory atomically: a temporary sibling, fsynced files, one rename.

A reader never sees half a dataset, and a build or import that fails (bad input, a full
disk, Ctrl-C) leaves nothing behind: the temporary directory is removed on any exception.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from perdure.data.errors import DataError
from perdure.data.manifest import MANIFEST_NAME, Manifest


@contextlib.contextmanager
def staged(out: str, overwrite: bool, what: str) -> Iterator[Path]:
    """Yield a temporary directory beside ``out``; on success ``commit`` renames it into
    place, on an exception it is removed. An existing ``out`` is an error unless
    ``overwrite`` (checked before any work is done)."""
    dest = Path(out)
    if dest.exists() and not overwrite:
        raise DataError(f"{what}: output {dest} already exists (pass overwrite=True / --force)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_file(path: Path, data: bytes | memoryview) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def commit(tmp: Path, out: str, manifest: Manifest) -> None:
    """Write ``manifest.json`` last into ``tmp``, then rename ``tmp`` to ``out``; an
    existing ``out`` is moved aside first, then removed."""
    write_file(tmp / MANIFEST_NAME, manifest.to_json().encode())
    dest = Path(out)
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}-{time.time_ns()}"
        os.rename(dest, old)
    os.rename(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
