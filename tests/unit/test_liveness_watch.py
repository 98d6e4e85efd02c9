"""The liveness lock and its watcher within one process (``control/liveness.py``): how a
lock is made, what the watcher refuses to watch, and that a lock its holder releases ends
the watch with no death notice. A killed holder: tests/integration/test_liveness.py."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from perdure.runtime.control import liveness

pytestmark = pytest.mark.skipif(
    liveness._LIBC is None or liveness.boot_id() is None, reason="needs Linux with glibc"
)


def _until_unwatched(watcher: liveness.Watcher) -> None:
    end = time.monotonic() + 10
    while watcher.watched:
        assert time.monotonic() < end, "the watch did not end"
        time.sleep(0.01)


def test_a_lock_appears_under_its_final_name_already_held(tmp_path: Path) -> None:
    held = liveness.hold(tmp_path, "w0")
    assert held is not None
    try:
        boot = liveness.boot_id()
        assert boot is not None
        assert held.path == liveness.lock_path(tmp_path, "w0", os.getpid(), boot)
        assert [p.name for p in held.path.parent.iterdir()] == [held.path.name]  # no .tmp
        assert held.path.stat().st_size == liveness.LOCK_BYTES
        mutex = liveness._map(held.path)
        assert mutex is not None
        answer: list[int] = []
        waiter = threading.Thread(target=lambda: answer.append(liveness._lock_for(mutex, 0.05)))
        waiter.start()
        waiter.join(10)
        assert answer == [errno.ETIMEDOUT]  # another thread cannot take it: it is held
    finally:
        held.release()


def test_a_lock_its_holder_releases_ends_the_watch_with_no_notice(tmp_path: Path) -> None:
    held = liveness.hold(tmp_path, "w0")
    assert held is not None
    watcher = liveness.Watcher(tmp_path)
    try:
        assert watcher.watch("w0", os.getpid())
        assert watcher.watch("w0", os.getpid())  # once: a second call finds it watched
        held.release()
        _until_unwatched(watcher)
        assert watcher.take() == []
        assert not held.path.exists()
    finally:
        held.release()
        watcher.close()


def test_a_file_that_is_no_lock_is_not_watched(tmp_path: Path) -> None:
    watcher = liveness.Watcher(tmp_path)
    boot = watcher.boot or ""
    try:
        assert not watcher.watch("gone", 1234)  # no file
        short = liveness.lock_path(tmp_path, "short", 1234, boot)
        short.parent.mkdir(parents=True)
        short.write_bytes(b"0" * 10)
        assert not watcher.watch("short", 1234)
        real = tmp_path / "real"
        real.write_bytes(b"\0" * liveness.LOCK_BYTES)
        liveness.lock_path(tmp_path, "link", 1234, boot).symlink_to(real)
        assert not watcher.watch("link", 1234)
        assert not watcher.watch("w0", 0)  # no pid
        assert not watcher.watched
    finally:
        watcher.close()


def test_the_watcher_stops_looking_for_a_lock_after_its_tries(tmp_path: Path) -> None:
    watcher = liveness.Watcher(tmp_path)
    held = None
    try:
        for _ in range(liveness.WATCH_TRIES):
            assert not watcher.watch("w0", os.getpid())
        held = liveness.hold(tmp_path, "w0")
        assert held is not None
        assert not watcher.watch("w0", os.getpid())  # a worker on another host: given up
        assert not watcher.watched
    finally:
        if held is not None:
            held.release()
        watcher.close()
