"""Fixture run directories for the report tests, written line by line (no training).

The run: workers a-0, a-1, b-0 over 4 slots and 30 steps. a-1 is killed at step 10
(membership epoch 1 from step 11 without it), its replacement rejoins at step 20
(epoch 2), and a dataset part is quarantined at step 25. No tests live here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

T0 = 1_700_000_000.0
STEPS = 30
KILL_STEP = 10
EPOCH1_STEP = 11
EPOCH2_STEP = 20

# (first step, members, slots) of each membership epoch
EPOCHS = [
    (0, ["a-0", "a-1", "b-0"], [2, 1, 1]),
    (EPOCH1_STEP, ["a-0", "b-0"], [2, 2]),
    (EPOCH2_STEP, ["a-0", "a-1", "b-0"], [2, 1, 1]),
]


def plan_at(step: int) -> tuple[int, list[str], list[int]]:
    """Membership epoch, members and slots in force at ``step``."""
    idx = max(i for i, (s, _, _) in enumerate(EPOCHS) if s <= step)
    _, members, slots = EPOCHS[idx]
    return idx, members, slots


def metrics_rows() -> list[dict[str, Any]]:
    rows = []
    for step in range(STEPS):
        epoch, members, slots = plan_at(step)
        rows.append(
            {
                "t": T0 + 5 + step * 0.1,
                "step": step,
                "loss": 5.0 - step * 0.05,
                "step_s": 0.5 if step == EPOCH1_STEP else 0.02,
                "tokens_per_s": 20000.0,
                "membership_epoch": epoch,
                "slots": slots,
                "members": members,
            }
        )
    return rows


def events_rows() -> list[dict[str, Any]]:
    def t(step: float) -> float:
        return T0 + 5 + step * 0.1

    ev: list[dict[str, Any]] = [
        {"t": T0, "event": "run_start", "run_dir": "x", "resume": None},
        {"t": T0 + 1, "event": "coordinator_up", "channel_port": 1},
    ]
    for w, r in (("a-0", "a"), ("a-1", "a"), ("b-0", "b")):
        ev.append({"t": T0 + 2, "event": "join", "worker": w, "region": r, "role": "worker"})
    for epoch, (start, members, _) in enumerate(EPOCHS):
        reason = ["start", "a-1 left: process exited", "a-1 joined"][epoch]
        ev.append(
            {
                "t": t(start) - 0.01,
                "event": "epoch_started",
                "epoch": epoch,
                "start_step": start,
                "source": "a-0",
                "receivers": ["a-1"] if epoch == 2 else [],
                "plan": {"members": members, "ranges": []},
                "reason": reason,
            }
        )
    ev += [
        {
            "t": t(KILL_STEP) + 0.01,
            "event": "fault_injected",
            "fault": 0,
            "kind": "kill",
            "target": "a-1",
            "step": KILL_STEP,
            "pids": [1],
        },
        {
            "t": t(KILL_STEP) + 0.03,
            "event": "collective_failed",
            "worker": "a-0",
            "epoch": 0,
            "error": "Connection reset by peer",
        },
        {"t": t(KILL_STEP) + 0.04, "event": "leave", "worker": "a-1", "reason": "exited"},
        {"t": t(KILL_STEP) + 0.05, "event": "process_exit", "worker": "a-1", "code": -9},
        {"t": t(15), "event": "replacement_started", "worker": "a-1"},
        {
            "t": t(EPOCH2_STEP) - 0.005,
            "event": "state_received",
            "worker": "a-1",
            "from": "a-0",
            "bytes": 300000,
            "seconds": 0.012,
            "next_step": EPOCH2_STEP,
        },
        {
            "t": t(25),
            "event": "decision",
            "step": 25,
            "kind": "quarantine",
            "parts": [3],
            "samples": [17, 18],
            "slot": 2,
            "reason": "non-finite loss",
        },
        {"t": t(STEPS), "event": "run_end", "next_step": STEPS},
    ]
    ev.sort(key=lambda e: e["t"])
    return ev


SUMMARY: dict[str, Any] = {
    "steps": STEPS,
    "wall_s": 8.9,
    "membership_changes": 2,
    "survivor_restarts": 0,
    "failures_observed": 1,
    "failures_absorbed": 1,
    "final_hash": "sha256:abc123",
    "faults": [
        {
            "fault": 0,
            "kind": "kill",
            "class": "hardware",
            "target": "a-1",
            "injected_step": KILL_STEP,
            "injected_t": T0 + 6,
            "detect_s": 0.02,
            "replan_s": 0.003,
            "state_copy_s": 0.012,
            "steps_lost": 0,
            "absorbed": True,
        }
    ],
    "faults_injected": 1,
    "faults_absorbed": 1,
    "goodput": 0.93,
    "reference": {"final_hash": "sha256:abc123", "bitwise_equal": True, "source": "cached"},
}


def write_jsonl(path: Path, rows: list[dict[str, Any]], torn_tail: str = "") -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + torn_tail)


def make_run_dir(
    root: Path,
    *,
    summary: dict[str, Any] | None = None,
    metrics: list[dict[str, Any]] | None = None,
    events: list[dict[str, Any]] | None = None,
    torn: bool = False,
) -> Path:
    """Write a fixture run directory under ``root`` and return it.

    ``torn`` appends half a JSON line to both JSON-lines files, as a killed writer leaves.
    """
    root.mkdir(parents=True, exist_ok=True)
    tail = '{"t": 1, "step": 9' if torn else ""
    write_jsonl(root / "metrics.jsonl", metrics if metrics is not None else metrics_rows(), tail)
    write_jsonl(root / "events.jsonl", events if events is not None else events_rows(), tail)
    (root / "summary.json").write_text(json.dumps(summary if summary is not None else SUMMARY))
    (root / "config.json").write_text(json.dumps({"train": {"steps": STEPS, "slots": 4}}))
    return root
