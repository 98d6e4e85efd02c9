"""A small record rewritten in space reserved once: the lease's writes need no free space.

The embedded lease is renewed several times a second into the run directory, which also
holds checkpoints and logs. A plain replace (temporary file, rename) allocates a new block
for every renewal, so a disk filled by a checkpoint stopped the lease, and with it the
whole control plane (the coordinator refused its own workers). Here the record lives in
two files of a fixed size, allocated when the lease is first taken: the live one and a
spare. A write overwrites the spare in place (its blocks exist: no allocation), fsyncs it
and swaps the two names atomically (``renameat2(RENAME_EXCHANGE)``), so a reader sees the
old record or the new one, never a mix, and the run directory's free space is never asked
for again.

Limits: ``RENAME_EXCHANGE`` is Linux's (local file systems, tmpfs; not NFS). Where it is
missing, or a record outgrows the reserve, the write falls back to a plain replace, which
needs one free block. The padding is spaces after the JSON text, which JSON readers skip.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
from pathlib import Path

from perdure.runtime.control.fence import write_replace

RESERVE_BYTES = 4096
"""Size of each of the two files: one page, far above a lease record (~200 bytes)."""

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _libc_renameat2() -> object | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.renameat2
    except (OSError, AttributeError):
        return None


_RENAMEAT2 = _libc_renameat2()


def exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b``; False where the system cannot."""
    if _RENAMEAT2 is None:
        return False
    rc = _RENAMEAT2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)  # type: ignore[operator]
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(a))


class ReservedRecord:
    """``path`` rewritten whole, in place of a pre-allocated spare (see module doc)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.spare = path.with_name(path.name + ".spare")
        self.exchanges = True

    def padded(self, data: bytes) -> bytes | None:
        if len(data) > RESERVE_BYTES:
            return None
        return data + b" " * (RESERVE_BYTES - len(data))

    def write(self, data: bytes) -> None:
        """Replace the record; raises OSError when the file system refuses."""
        body = self.padded(data)
        if body is not None and self.exchanges and self._ready():
            fd = os.open(self.spare, os.O_WRONLY)
            try:
                os.pwrite(fd, body, 0)
                os.fsync(fd)
            finally:
                os.close(fd)
            if exchange(self.spare, self.path):
                _fsync_dir(self.path.parent)
                return
            self.exchanges = False
        if body is not None and self.exchanges:
            try:
                self.reserve(body)
                return
            except OSError:
                pass  # no room for the reserve: a plain replace may still fit
        write_replace(self.path, data)

    def reserve(self, body: bytes) -> None:
        """The first write: the record and its spare, both full size (allocates twice)."""
        write_replace(self.path, body)
        tmp = self.spare.with_name(self.spare.name + f".tmp-{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.replace(tmp, self.spare)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _fsync_dir(self.path.parent)

    def _ready(self) -> bool:
        """Both files exist at full size (a lease file from before this module: no)."""
        try:
            return (
                self.spare.stat().st_size == RESERVE_BYTES
                and self.path.stat().st_size == RESERVE_BYTES
            )
        except FileNotFoundError:
            return False


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
