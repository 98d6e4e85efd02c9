"""The run directory's fence: the newest coordinator generation, checked by every writer.

A coordinator that acquires the run's lease (``control/lease.py``) with generation ``g``
installs ``g`` here, in ``RUN_DIR/control/fence.json``, *before* it admits a worker. Every
writer of the run directory holds the generation it works for (a worker: its epoch's, from
the ``start``; the summary: the generation that ended the run) and compares it with the
fence before it writes: a writer whose generation is older is fenced out (:class:`Fenced`)
and writes nothing. This is the fencing-token rule, applied where the writes land, so it
holds on any file system the run directory lives on, whatever the lease backend.

The file is replaced whole (temporary name, fsync, rename, directory fsync) under an
``flock`` of ``fence.lock``, and never lowered: an installer whose generation is not above
the fence's changes nothing. Readers need no lock (a rename is atomic), and on NFS the
close-to-open rule makes each ``open`` see the newest rename.

Limit (stated, not hidden): the check is check-then-write. A fence installed between a
writer's check and its write does not stop that write. What bounds the window: a new
generation is installed only after the old one's lease lapsed *and* its coordinator did not
answer as serving, and the old coordinator stops its workers before its own lease runs out
(``policy.py``); so an old-generation write after the fence moved needs a writer that was
paused, or cut off from its coordinator without its connection closing, across a whole
lease TTL, and even then it lands at most once per writer: a worker reads the fence before
every step (the step's metrics line is admitted by that read) and every heartbeat, a
checkpoint commit reads it just before its rename.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

FENCE = "control/fence.json"
LOCK = "control/fence.lock"
LOCK_TIMEOUT_S = 5.0


class Fenced(RuntimeError):
    """A writer's generation is older than the run directory's fence."""

    def __init__(self, what: str, mine: int, newer: int, path: Path) -> None:
        super().__init__(
            f"{what} refused: this writer works for coordinator generation {mine}, "
            f"but {path} is at generation {newer} (a newer coordinator took over)"
        )
        self.mine, self.newer = mine, newer


def fence_path(run_dir: str | Path) -> Path:
    return Path(run_dir) / FENCE


def read_fence(run_dir: str | Path) -> dict[str, Any] | None:
    """The fence's record (``generation``, ``holder``), or None when none is installed.
    A file that is not a fence record raises ValueError naming it: guessing a
    generation would let a stale writer through."""
    path = fence_path(run_dir)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        record = json.loads(data)
        ok = isinstance(record, dict) and isinstance(record.get("generation"), int)
    except (json.JSONDecodeError, UnicodeDecodeError):
        ok = False
    if not ok:
        raise ValueError(f"{path}: not a fence record (want a JSON object with 'generation')")
    return dict(record)


def current_generation(run_dir: str | Path) -> int:
    """The fence's generation; 0 when none was installed."""
    record = read_fence(run_dir)
    return 0 if record is None else int(record["generation"])


class Fence:
    """A writer's view of the fence: ``check(generation, what)`` before each write."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)

    def current(self) -> int:
        return current_generation(self.run_dir)

    def check(self, generation: int, what: str) -> None:
        """Raise :class:`Fenced` when ``generation`` is older than the fence."""
        newer = self.current()
        if generation < newer:
            raise Fenced(what, generation, newer, fence_path(self.run_dir))


def install_fence(run_dir: str | Path, generation: int, holder: dict[str, Any]) -> bool:
    """Raise the fence to ``generation``; False (nothing written) when it is already there
    or higher: a delayed installer never lowers it."""
    path = fence_path(run_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with lock_file(Path(run_dir) / LOCK, LOCK_TIMEOUT_S):
        if current_generation(run_dir) >= generation:
            return False
        record = {"generation": generation, "holder": holder, "installed_unix": time.time()}
        write_replace(path, json.dumps(record, separators=(",", ":")).encode() + b"\n")
    return True


def write_replace(path: Path, data: bytes) -> None:
    """Replace ``path`` whole and durably: temporary name, fsync, rename, directory fsync."""
    tmp = path.with_name(f"{path.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


@contextlib.contextmanager
def lock_file(path: Path, timeout_s: float) -> Iterator[None]:
    """An exclusive ``flock`` of ``path``, waited for at most ``timeout_s`` (TimeoutError
    naming the file): a lock held by a process stuck on a dead file server must not hang
    the coordinator."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        end = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > end:
                    raise TimeoutError(f"{path}: lock not free within {timeout_s:g} s") from None
                time.sleep(0.005)
        yield
    finally:
        os.close(fd)  # releases the lock


__all__ = [
    "FENCE",
    "Fence",
    "Fenced",
    "current_generation",
    "fence_path",
    "install_fence",
    "lock_file",
    "read_fence",
    "write_replace",
]
