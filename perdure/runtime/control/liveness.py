"""A killed worker, seen by the coordinator on its host as the kernel begins to end it.

Without this, a killed worker is detected when its sockets close, and the kernel closes
them only after it has unmapped the process's memory: 10-18 ms for a worker here (~290 MB
resident, most of it torch's; measured from ``SIGKILL`` to the peer's end-of-file), far
more for a process that holds a GPU context. But the kernel releases a dying thread's
*robust* futexes at the start of its exit, before the memory goes (``exit_mm`` walks the
robust list before ``mmput``). So each worker holds a process-shared robust mutex in a
small file of the run directory (:func:`hold`), and the coordinator, where it runs on the
same host, waits on it in a thread (:class:`Watcher`): the wait ends with ``EOWNERDEAD``
0.2 ms after the kill (10-11 ms for the same process's socket), and the coordinator
treats it as the worker's closed connection.

A worker that ends by itself (its ``run`` returns or raises) unlocks the mutex first
(:meth:`Held.release`), so only a death the worker did not choose (a signal, the
interpreter's crash) gives the notice; a clean exit is seen as before, when its
connection closes after its last message.

The file (this module owns its format): ``RUN_DIR/control/alive/NAME.PID.BOOT.lock``,
``BOOT`` the first 12 hex digits of the host's boot id (a futex is not shared between
hosts, even where the run directory is: a coordinator watches only the locks made on its
own boot of its own host), ``LOCK_BYTES`` bytes, a ``pthread_mutex_t`` at offset 0; made
locked under a temporary name, then renamed, so a watcher never finds it unlocked.

Limits: Linux with glibc only (robust, process-shared mutexes through ``ctypes``);
elsewhere, or where the run directory cannot be mapped shared, no lock is made and the
closed socket is the only detection, as before. A worker on another host is not watched
(its socket and its heartbeats tell). Whoever can write the run directory can forge or
remove a lock, as they can the checkpoints beside it: a forged death evicts only the
worker process the coordinator names by its pid, which then rejoins.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import socket
import stat
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

log = logging.getLogger("perdure.liveness")

FOLDER = "control/alive"
"""Where the locks live, under the run directory."""

LOCK_BYTES = 64
"""A lock file's size: a ``pthread_mutex_t`` (40 bytes on x86-64, 48 on arm64) at 0."""

WAIT_SLICE_S = 0.25
"""How long one wait on a lock lasts before the watcher checks whether it must stop."""

WATCH_TRIES = 50
"""How many of a worker's messages the coordinator looks for its lock at before it stops
looking (a worker on another host never makes one here)."""

_PTHREAD_PROCESS_SHARED = 1
_PTHREAD_MUTEX_ROBUST = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _libc() -> Any:
    """glibc's pthread functions, or None where robust mutexes are not to be had."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    needed = ("pthread_mutexattr_setrobust", "pthread_mutex_consistent", "pthread_mutex_init")
    return libc if all(hasattr(libc, f) for f in needed) else None


_LIBC = _libc()
_CLOCKED = _LIBC is not None and hasattr(_LIBC, "pthread_mutex_clocklock")
"""glibc waits on the monotonic clock (``pthread_mutex_clocklock``, 2.30 and later)."""


def boot_id() -> str | None:
    """This boot of this host, as the lock files name it (None: not Linux)."""
    try:
        raw = Path("/proc/sys/kernel/random/boot_id").read_text()
    except OSError:
        return None
    digits = raw.strip().replace("-", "")
    return digits[:12] if len(digits) >= 12 else None


def lock_path(run_dir: str | Path, name: str, pid: int, boot: str) -> Path:
    return Path(run_dir) / FOLDER / f"{name}.{pid}.{boot}.lock"


class Held:
    """A worker's lock, locked by the thread that made it (the worker's main thread).
    ``mutex`` is a ``ctypes`` array over the file's shared mapping, which it keeps."""

    def __init__(self, path: Path, mutex: Any) -> None:
        self.path, self._mutex = path, mutex
        self._held = True

    def release(self) -> None:
        """A clean exit: unlock (no death notice follows) and remove the file. Call on
        the thread that locked it."""
        if not self._held:
            return
        self._held = False
        _LIBC.pthread_mutex_unlock(self._mutex)
        with contextlib.suppress(OSError):
            self.path.unlink()


def hold(run_dir: str | Path, name: str) -> Held | None:
    """Make this process's lock, locked by the calling thread, or None where it cannot be
    made (not Linux with glibc, a run directory that cannot be mapped shared): the
    closed socket then tells the coordinator, as without it."""
    boot = boot_id()
    if _LIBC is None or boot is None:
        return None
    path = lock_path(run_dir, name, os.getpid(), boot)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, LOCK_BYTES)
            mm = mmap.mmap(fd, LOCK_BYTES)
        finally:
            os.close(fd)
        mutex = (ctypes.c_char * LOCK_BYTES).from_buffer(mm)
        _init_locked(mutex)
        os.replace(tmp, path)
    except OSError as e:
        log.info("%s: no liveness lock (%s); its death is seen when its socket closes", name, e)
        with contextlib.suppress(OSError):
            tmp.unlink()
        return None
    return Held(path, mutex)


def _init_locked(mutex: Any) -> None:
    attr = ctypes.create_string_buffer(16)  # pthread_mutexattr_t: 4 bytes on Linux
    calls = (
        ("pthread_mutexattr_init", lambda: _LIBC.pthread_mutexattr_init(attr)),
        ("setpshared", lambda: _LIBC.pthread_mutexattr_setpshared(attr, _PTHREAD_PROCESS_SHARED)),
        ("setrobust", lambda: _LIBC.pthread_mutexattr_setrobust(attr, _PTHREAD_MUTEX_ROBUST)),
        ("pthread_mutex_init", lambda: _LIBC.pthread_mutex_init(mutex, attr)),
        ("pthread_mutex_lock", lambda: _LIBC.pthread_mutex_lock(mutex)),
    )
    for what, call in calls:
        rc = call()
        if rc != 0:
            raise OSError(rc, f"{what}: {os.strerror(rc)}")


class Watcher:
    """The coordinator's side: a thread per watched lock, each waiting for its worker's
    death; the deaths are queued for the coordinator's loop, which selects on ``wake``."""

    def __init__(self, run_dir: str | Path) -> None:
        self.run_dir = Path(run_dir)
        self.boot = boot_id()
        self.wake, self._poke = socket.socketpair()
        self.wake.setblocking(False)
        self._poke.setblocking(False)
        self._dead: deque[tuple[str, int]] = deque()
        self._stop = threading.Event()
        self._tries: dict[tuple[str, int], int] = {}
        self.watched: set[tuple[str, int]] = set()

    def watch(self, name: str, pid: int) -> bool:
        """Start waiting on ``name``'s lock (process ``pid``) if it is here; False if it
        is not (yet): the caller may ask again, at most ``WATCH_TRIES`` times."""
        key = (name, pid)
        if key in self.watched or _LIBC is None or self.boot is None or pid <= 0:
            return key in self.watched
        tries = self._tries.get(key, 0)
        if tries >= WATCH_TRIES:
            return False
        self._tries[key] = tries + 1
        path = lock_path(self.run_dir, name, pid, self.boot)
        mutex = _map(path)
        if mutex is None:
            return False
        self.watched.add(key)
        self._tries.pop(key, None)
        args = (name, pid, path, mutex)
        thread = threading.Thread(target=self._wait, args=args, daemon=True, name=f"alive-{name}")
        thread.start()
        return True

    def take(self) -> list[tuple[str, int]]:
        """The deaths seen since the last call, as ``(name, pid)``."""
        with contextlib.suppress(OSError):
            while self.wake.recv(4096):
                pass
        out = []
        while self._dead:
            out.append(self._dead.popleft())
        return out

    def close(self) -> None:
        """Stop every wait (each ends within ``WAIT_SLICE_S``; the threads are daemons)."""
        self._stop.set()
        self.wake.close()
        self._poke.close()

    def _wait(self, name: str, pid: int, path: Path, mutex: Any) -> None:
        """Until the holder dies (queued, the coordinator woken), releases its lock, or
        :meth:`close`; the mapping goes with the thread's last reference to ``mutex``."""
        try:
            while not self._stop.is_set():
                rc = _lock_for(mutex, WAIT_SLICE_S)
                if rc == errno.ETIMEDOUT:
                    continue
                if rc == errno.EOWNERDEAD:  # the kernel released it: the holder died
                    _LIBC.pthread_mutex_consistent(mutex)
                    _LIBC.pthread_mutex_unlock(mutex)
                    with contextlib.suppress(OSError):
                        path.unlink()
                    self._dead.append((name, pid))
                    with contextlib.suppress(OSError):
                        self._poke.send(b"!")
                elif rc == 0:  # its worker unlocked it: a clean exit, told by its socket
                    _LIBC.pthread_mutex_unlock(mutex)
                return  # any other answer (a file that is no lock): stop watching
        finally:
            self.watched.discard((name, pid))


def _map(path: Path) -> Any:
    """A ``ctypes`` array over ``path`` mapped shared (it keeps the mapping), if ``path``
    is a regular file of ``LOCK_BYTES`` bytes; else None."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size != LOCK_BYTES:
            return None
        mm = mmap.mmap(fd, LOCK_BYTES)
    except OSError:
        return None
    finally:
        os.close(fd)
    return (ctypes.c_char * LOCK_BYTES).from_buffer(mm)


def _lock_for(mutex: Any, seconds: float) -> int:
    """Lock ``mutex``, waiting at most ``seconds`` (the monotonic clock where glibc has
    ``pthread_mutex_clocklock``): 0, ``ETIMEDOUT``, ``EOWNERDEAD`` or another error."""
    clock = time.CLOCK_MONOTONIC if _CLOCKED else time.CLOCK_REALTIME  # timedlock's clock
    deadline = time.clock_gettime(clock) + seconds
    ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
    if _CLOCKED:
        return int(_LIBC.pthread_mutex_clocklock(mutex, clock, ctypes.byref(ts)))
    return int(_LIBC.pthread_mutex_timedlock(mutex, ctypes.byref(ts)))


__all__ = ["Held", "Watcher", "boot_id", "hold", "lock_path"]
