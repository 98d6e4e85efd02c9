"""A writer SIGKILLed at each named point of a save leaves the previous checkpoint intact
and no committed partial one (hooks: perdure/checkpoint/hooks.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from perdure.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from perdure.checkpoint.config import CheckpointConfig
from perdure.checkpoint.hooks import ENV, POINTS
from tests.checkpoint_support import make_state, same_tree

HERE = Path(__file__).resolve().parents[1]
SAVE_STEP_2 = f"""
import sys
sys.path.insert(0, {str(HERE.parent)!r})
from tests.checkpoint_support import make_state
from perdure.checkpoint import save_checkpoint
save_checkpoint(sys.argv[1], make_state(step=2, seed=2))
"""


def _kill_during_save(root: Path, point: str) -> int:
    env = {**os.environ, ENV: point}
    proc = subprocess.run(
        [sys.executable, "-c", SAVE_STEP_2, str(root)], env=env, timeout=60, capture_output=True
    )
    return proc.returncode


@pytest.mark.parametrize("point", [p for p in POINTS if p != "after_rename"])
def test_kill_before_commit_leaves_previous_checkpoint_and_no_partial_one(
    tmp_path: Path, point: str
) -> None:
    first = make_state(step=1, seed=1)
    save_checkpoint(tmp_path, first)
    assert _kill_during_save(tmp_path, point) == -signal.SIGKILL
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-000000001"]
    assert not (tmp_path / "step-000000002").exists()
    assert any(".tmp-" in p.name for p in tmp_path.iterdir()), "debris of the killed save"
    latest = latest_checkpoint(tmp_path)
    assert latest is not None
    assert same_tree(load_checkpoint(latest).model, first.model)
    # The next save commits and its retention removes the debris.
    save_checkpoint(tmp_path, make_state(step=3), retention=CheckpointConfig(keep_last=5))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000000001", "step-000000003"]


def test_kill_after_rename_leaves_the_new_checkpoint_complete(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, make_state(step=1, seed=1))
    assert _kill_during_save(tmp_path, "after_rename") == -signal.SIGKILL
    latest = latest_checkpoint(tmp_path)
    assert latest is not None and latest.name == "step-000000002"
    assert same_tree(load_checkpoint(latest).model, make_state(step=2, seed=2).model)
