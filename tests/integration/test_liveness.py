"""A worker's liveness lock (``control/liveness.py``): the kernel's release of a killed
holder's robust mutex reaches the watcher, named by the holder's name and pid; a holder
that releases its lock itself (a clean exit) is never reported dead."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from perdure.runtime.control import liveness

pytestmark = pytest.mark.skipif(liveness.boot_id() is None, reason="needs Linux")

_HOLDER = """
import sys, time
from perdure.runtime.control import liveness
held = liveness.hold(sys.argv[1], "w0")
print("held" if held else "none", flush=True)
if sys.argv[2] == "release":
    sys.stdin.readline()
    held.release()
    sys.exit(0)
ballast = bytearray(200 << 20)  # memory to unmap: its socket closes ~15 ms after a kill
ballast[::4096] = b"x" * len(ballast[::4096])
print("ready", flush=True)
time.sleep(120)
"""


def _holder(run_dir: Path, mode: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(run_dir), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held", "glibc's robust mutexes are needed"
    return proc


def _until(what: str, cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_killed_holder_is_reported_by_name_and_pid_and_its_lock_removed(tmp_path: Path) -> None:
    proc = _holder(tmp_path, "ballast")
    watcher = liveness.Watcher(tmp_path)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert watcher.watch("w0", proc.pid)
        path = liveness.lock_path(tmp_path, "w0", proc.pid, watcher.boot or "")
        assert path.exists()
        proc.send_signal(signal.SIGKILL)
        readable, _, _ = select.select([watcher.wake], [], [], 30)
        assert readable, "no death notice"
        assert watcher.take() == [("w0", proc.pid)]
        assert proc.wait(timeout=30) == -signal.SIGKILL
        assert not path.exists()
        assert watcher.take() == []
    finally:
        proc.kill()
        proc.wait()
        watcher.close()


def test_a_holder_that_releases_its_lock_and_exits_is_never_reported(tmp_path: Path) -> None:
    proc = _holder(tmp_path, "release")
    watcher = liveness.Watcher(tmp_path)
    try:
        assert watcher.watch("w0", proc.pid)
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
        _until("the watch to end", lambda: not watcher.watched)
        assert watcher.take() == []
        assert not list((tmp_path / liveness.FOLDER).iterdir())
    finally:
        proc.kill()
        proc.wait()
        watcher.close()
