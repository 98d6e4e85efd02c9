"""The README's first command, in a fresh clone, on the shortened schedule."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _fresh_clone(tmp: Path) -> Path:
    clone = tmp / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=60)
    # The clone gets the working tree's current files (uncommitted edits included), so the
    # test checks this change, not only the last commit.
    for rel in subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.split():  # fmt: skip
        src = ROOT / rel
        if src.is_file():
            (clone / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, clone / rel)
    return clone


@pytest.mark.timeout(180)
def test_make_demo_quick_in_a_fresh_clone_absorbs_all_four_classes_bit_exactly(
    tmp_path: Path,
) -> None:
    clone = _fresh_clone(tmp_path)
    venv = Path(sys.prefix)  # reuse this environment: creating one is `make`'s first-use cost
    env = {**os.environ, "PYTHONPATH": str(clone)}
    out = subprocess.run(
        ["make", "-o", f"{venv}/.installed", "demo", f"VENV={venv}",
         "DEMO_ARGS=--quick --run-dir runs/demo-test --no-live"],
        cwd=clone, env=env, capture_output=True, text=True, timeout=170,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    summary = json.loads((clone / "runs/demo-test/summary.json").read_text())
    classes = {f["class"] for f in summary["faults"]}
    assert classes == {"hardware", "network", "partial_cluster_loss", "data"}
    assert summary["faults_absorbed"] == summary["faults_injected"] == 4
    assert summary["survivor_restarts"] == 0 and summary["steps_lost"] == 0
    assert summary["failures_absorbed"] == summary["failures_observed"] > 0
    assert summary["reference"]["bitwise_equal"] is True
    assert summary["final_hash"] == summary["reference"]["final_hash"]
    assert "bitwise-equal to the fault-free reference (ran): YES" in out.stdout
    assert (clone / "runs/demo-test/report.html").is_file()
