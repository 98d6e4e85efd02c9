"""Durable local file operations: whole writes, fsync of files and directories."""

from __future__ import annotations

import os
from pathlib import Path
from typing import BinaryIO

MAX_WRITE = 64 << 20
"""Bytes per ``write`` call; Linux caps one call near 2 GiB anyway."""


def write_all(f: BinaryIO, mv: memoryview) -> None:
    """Write every byte of ``mv`` (``write`` on an unbuffered file may write fewer)."""
    while len(mv):
        n = f.write(mv[:MAX_WRITE])
        if n is None:
            raise OSError(f"{getattr(f, 'name', '?')}: non-blocking write would block")
        mv = mv[n:]


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (created, renamed files) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durable(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` and fsync it (the caller fsyncs the directory)."""
    with open(path, "wb", buffering=0) as f:
        write_all(f, memoryview(data))
        os.fsync(f.fileno())


def readinto_all(f: BinaryIO, mv: memoryview, name: str) -> None:
    """Fill ``mv`` from ``f``; a short file is an error naming it."""
    from perdure.checkpoint.errors import CorruptCheckpointError

    while len(mv):
        n = f.readinto(mv[:MAX_WRITE])  # type: ignore[attr-defined]
        if not n:
            raise CorruptCheckpointError(name, "truncated: the file ends before its data does")
        mv = mv[n:]
