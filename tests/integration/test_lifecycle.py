"""Every process of a run ends with the run, whatever killed the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.proc_support import descendants

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")

_CHILD = """
import os, sys, time
from perdure.lifecycle import die_with_parent
assert die_with_parent()
print(os.getpid(), flush=True)
time.sleep(60)
"""
_PARENT = """
import os, subprocess, sys, time
env = {**os.environ, "PERDURE_PARENT_PID": str(os.getpid())}
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE)
print(child.stdout.readline().decode().strip(), flush=True)
time.sleep(60)
"""


def _gone(pid: int, within_s: float) -> bool:
    end = time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def test_a_child_dies_when_its_parent_is_sigkilled() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, _CHILD], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline().strip())
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    assert _gone(child, 10), f"child {child} outlived its parent"


def test_a_child_whose_parent_is_already_gone_exits_at_once(tmp_path: Path) -> None:
    env = {**os.environ, "PERDURE_PARENT_PID": "1"}  # not our parent: it "died" before us
    code = "from perdure.lifecycle import die_with_parent; die_with_parent(); print('alive')"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert out.returncode == 1 and b"alive" not in out.stdout


def test_a_process_started_by_hand_is_left_alone() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PERDURE_PARENT_PID"}
    code = "from perdure.lifecycle import die_with_parent; print(die_with_parent())"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=30)
    assert out.stdout.strip() == b"False"


_LAUNCHER = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from tests.runtime_support import run_to_end, small_config
host = sys.argv[4] if len(sys.argv) > 4 else "127.0.0.1"
cfg = small_config(Path(sys.argv[1]), workers=2, steps=100000, cluster={"host": host})
run_to_end(cfg, Path(sys.argv[2]), timeout_s=120)
"""


def test_killing_the_launcher_leaves_no_process_of_the_run(
    small_dataset: Path, tmp_path: Path
) -> None:
    root = str(Path(__file__).resolve().parents[2])
    launcher = subprocess.Popen(
        [sys.executable, "-c", _LAUNCHER, str(small_dataset), str(tmp_path / "run"), root]
    )
    try:
        metrics = tmp_path / "run" / "metrics.jsonl"
        end = time.monotonic() + 60
        while not (metrics.exists() and metrics.stat().st_size > 0):
            assert time.monotonic() < end and launcher.poll() is None, "the run never stepped"
            time.sleep(0.1)
        procs = descendants(launcher.pid)
        assert len(procs) >= 4  # coordinator, zygote, two workers
    finally:
        launcher.kill()
        launcher.wait(10)
    left = [p for p in procs if not _gone(p, 15)]
    assert left == [], f"processes of the run outlived its launcher: {left}"


_STEPS = 150


def test_sigterm_to_the_launcher_drains_the_run_to_an_intact_final_checkpoint(
    small_dataset: Path, tmp_path: Path
) -> None:
    import json

    from perdure import events as ev
    from perdure.checkpoint import latest_checkpoint, load_checkpoint, read_manifest
    from tests.runtime_support import events

    root = str(Path(__file__).resolve().parents[2])
    script = _LAUNCHER.replace("steps=100000", f"steps={_STEPS}")
    rd = tmp_path / "run"
    launcher = subprocess.Popen([sys.executable, "-c", script, str(small_dataset), str(rd), root])
    try:
        metrics = rd / "metrics.jsonl"
        end = time.monotonic() + 60
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 20):
            assert time.monotonic() < end and launcher.poll() is None, "the run never stepped"
            time.sleep(0.1)
        procs = descendants(launcher.pid)
        t0 = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(30) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert time.monotonic() - t0 < 30
    assert [p for p in procs if not _gone(p, 10)] == []
    summary = json.loads((rd / "summary.json").read_text())
    [drain] = events(rd, ev.RUN_DRAINING)
    ckpt = latest_checkpoint(rd / "checkpoints")
    assert ckpt is not None and int(read_manifest(ckpt)["step"]) == drain["step"]
    assert summary["last_step"] == drain["step"] - 1 < _STEPS - 1
    assert load_checkpoint(ckpt).step == drain["step"]  # whole, all seven fields: resumable
