"""Free space for checkpoints: what a file system has, what a save needs, and making room.

A save that fails for want of space (``ENOSPC``) costs that checkpoint, not the run. The
saver then says which file system is full, how much it has and how much the save needed
(``checkpoint_failed``), and asks retention to make room for the next due save: the oldest
committed checkpoints go first, beyond what ``keep_last`` and ``keep_every`` asked for, but
the newest committed one, the run's last good state on disk, is never deleted.

Limits: the numbers are ``statvfs``'s (space for an unprivileged writer), read when the
save failed; another writer on the same file system can take the room before the retry.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from perdure.checkpoint import layout

SLACK = 1.05
"""Room asked for: the tensor bytes plus this fraction (headers, context, manifest)."""
SLACK_BYTES = 1 << 20


@dataclass(frozen=True)
class Space:
    """A file system as a full save saw it."""

    mount: str
    """The mount point holding the checkpoint directory."""
    fstype: str
    free_bytes: int
    total_bytes: int

    def to_dict(self) -> dict[str, object]:
        return {"file_system": self.mount, "fstype": self.fstype,
                "free_bytes": self.free_bytes, "total_bytes": self.total_bytes}  # fmt: skip


def needed_bytes(tensor_bytes: int) -> int:
    """What a save of ``tensor_bytes`` asks of the file system (an estimate from above)."""
    return int(tensor_bytes * SLACK) + SLACK_BYTES


def space_of(path: str | Path) -> Space:
    """The file system of ``path`` (or of its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    st = os.statvfs(p)
    mount = p
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    return Space(str(mount), _fstype(str(mount)), st.f_bavail * st.f_frsize,
                 st.f_blocks * st.f_frsize)  # fmt: skip


def _fstype(mount: str) -> str:
    try:
        with open("/proc/self/mounts") as f:
            found = "unknown"
            for line in f:
                parts = line.split()
                if len(parts) > 2 and parts[1] == mount:
                    found = parts[2]  # the last one listed is the one on top
            return found
    except OSError:
        return "unknown"


def is_no_space(e: BaseException | None) -> bool:
    """Whether ``e`` or its cause chain is a full file system (ENOSPC or EDQUOT)."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
        e, seen = e.__cause__ or e.__context__, seen + 1
    return False


def make_room(root: str | Path, needed: int) -> list[Path]:
    """Delete the oldest committed checkpoints under ``root`` until ``needed`` bytes are
    free, never the newest committed one; returns what was deleted (maybe not enough)."""
    from perdure.checkpoint.discovery import _delete, latest_checkpoint, list_checkpoints

    root = Path(root)
    newest = latest_checkpoint(root)
    deleted: list[Path] = []
    for p in list_checkpoints(root):  # oldest first
        if space_of(root).free_bytes >= needed:
            break
        if newest is not None and p.resolve() == newest.resolve():
            continue
        if newest is not None and (layout.step_of(p) or 0) > (layout.step_of(newest) or 0):
            continue  # newer than the newest intact one: corrupt, but not ours to judge here
        _delete(p)
        deleted.append(p)
    return deleted
