"""No process of a run listens on an address other than ``cluster.host``."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_lifecycle import _LAUNCHER
from tests.proc_support import descendants

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")


def _listeners(pids: set[int]) -> list[str]:
    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, timeout=10).stdout
    found = []
    for line in out.splitlines():
        owners = {int(p) for p in re.findall(r"pid=(\d+)", line)}
        if owners & pids:
            found.append(line.split()[3])
    return found


def test_every_listener_of_a_run_is_on_the_configured_host(
    small_dataset: Path, tmp_path: Path
) -> None:
    root = str(Path(__file__).resolve().parents[2])
    rd = tmp_path / "run"
    host = "127.0.0.2"  # not what the host name resolves to: only the config can say it
    cmd = [sys.executable, "-c", _LAUNCHER, str(small_dataset), str(rd), root, host]
    launcher = subprocess.Popen(cmd)
    try:
        metrics = rd / "metrics.jsonl"
        end = time.monotonic() + 60
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert time.monotonic() < end and launcher.poll() is None, "the run never stepped"
            time.sleep(0.1)
        addrs = _listeners(descendants(launcher.pid))
    finally:
        launcher.kill()
        launcher.wait(10)
    # channel and store of the coordinator, and each worker's gloo listener at least
    assert len(addrs) >= 4, addrs
    assert [a for a in addrs if not a.startswith(f"{host}:")] == []
