"""A small file system of its own for a test's checkpoints (a tmpfs: needs root)."""

from __future__ import annotations

import contextlib
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def small_tmpfs(parent: Path, mib: int) -> Iterator[Path]:
    """A ``mib`` MiB tmpfs mounted under ``parent`` for the block (the test is skipped,
    saying why, where it cannot be mounted); unmounted after."""
    mnt = parent / f"disk-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={mib}m", "tmpfs", str(mnt)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.decode()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
