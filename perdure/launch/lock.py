"""One launcher per run directory: a second one (a resume included) is refused.

Two launchers in one directory interleave their ``events.jsonl`` and one's checkpoint
retention deletes what the other is loading. The lock is an ``flock`` on
``RUN_DIR/.lock``, which the kernel drops when its holder dies however it dies, so a
killed launcher never leaves a stale lock; the file also names the holder's pid for the
refusal message. Limit: ``flock`` on a network file system (NFS) may be local to one
machine; a run directory shared across hosts needs the coordinator's fencing instead.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from types import TracebackType


class RunDirLocked(RuntimeError):
    """Another live launcher holds this run directory."""


class RunDirLock:
    """``with RunDirLock(run_dir):`` holds the directory for the block."""

    def __init__(self, run_dir: str | Path) -> None:
        self.path = Path(run_dir) / ".lock"
        self.fd: int | None = None

    def __enter__(self) -> RunDirLock:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirLocked(
                f"--run-dir {self.path.parent}: a run is going on there (launcher pid "
                f"{holder}); stop it first, or choose another directory"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self.fd = fd
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None
