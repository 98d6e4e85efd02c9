"""A run directory: private to its user, and held by one launcher at a time."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from perdure.launch.lock import RunDirLock, RunDirLocked
from tests.runtime_support import run_to_end, small_config


def test_a_second_launcher_is_refused_naming_the_holders_pid(tmp_path: Path) -> None:
    with RunDirLock(tmp_path), pytest.raises(RunDirLocked, match=f"launcher pid {os.getpid()}"):
        RunDirLock(tmp_path).__enter__()
    with RunDirLock(tmp_path):  # released: the next one gets it
        pass


def test_a_killed_holder_leaves_no_stale_lock(tmp_path: Path) -> None:
    code = (
        "import sys, time; from perdure.launch.lock import RunDirLock;"
        "RunDirLock(sys.argv[1]).__enter__(); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    with pytest.raises(RunDirLocked, match=str(holder.pid)):
        RunDirLock(tmp_path).__enter__()
    holder.kill()
    holder.wait(10)
    time.sleep(0.1)
    with RunDirLock(tmp_path):
        pass


def test_a_resume_into_a_run_that_is_still_going_is_refused(
    small_dataset: Path, tmp_path: Path
) -> None:
    from perdure.launch.api import run

    cfg = small_config(small_dataset, workers=1, steps=4)
    rd = tmp_path / "run"
    rd.mkdir()
    with RunDirLock(rd), pytest.raises(RunDirLocked, match="a run is going on there"):
        run(cfg, run_dir=rd, resume="latest")


def test_what_a_run_writes_is_private_to_its_user_but_its_report(
    small_dataset: Path, tmp_path: Path
) -> None:
    """Every file and folder a run writes is its user's alone, except report.html (0644,
    for sharing); the run directory lets others open it by name (0711), not list it."""
    rd = tmp_path / "run"
    run_to_end(small_config(small_dataset, workers=1, steps=4), rd)
    paths = list(rd.rglob("*"))
    assert len(paths) > 10
    leaky = [
        str(p.relative_to(tmp_path))
        for p in paths
        if not p.is_symlink() and stat.S_IMODE(p.stat().st_mode) & 0o077
    ]
    assert leaky == ["run/report.html"]
    assert stat.S_IMODE((rd / "report.html").stat().st_mode) == 0o644
    assert stat.S_IMODE(rd.stat().st_mode) == 0o711
