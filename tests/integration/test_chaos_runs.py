"""The four failure classes, injected live with real signals: zero survivor restarts, zero
committed steps lost, and final parameters bitwise-equal to the fault-free run."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from perdure.runtime.control.detector import PhiAccrual
from tests.runtime_support import events, run_to_end, small_config, story

STEPS = 400
POISON = {"kind": "poison_part", "target": "3", "at_step": 40}


def _config(dataset: Path, faults: list[dict[str, Any]], **cluster: Any) -> Any:
    return small_config(
        dataset,
        workers=3,
        regions=2,
        steps=STEPS,
        slots=8,
        cluster={"coordinator_region": "r0", "standby_region": "r1", **cluster},
        checkpoint={"every_steps": 100},
        chaos={"faults": faults},
    )


@pytest.fixture(scope="module")
def clean_ref(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_to_end(_config(small_dataset, []), tmp_path_factory.mktemp("clean"))


@pytest.fixture(scope="module")
def poison_ref(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("poison")
    return {**run_to_end(_config(small_dataset, [POISON]), run_dir), "run_dir": run_dir}


def _assert_absorbed(s: dict, ref: dict, kinds: list[str], run_dir: Path) -> None:
    seen = {k: s.get(k) for k in ("faults", "failures", "membership_changes", "decisions")}
    assert s["final_hash"] == ref["final_hash"], (seen, story(run_dir))
    assert (s["survivor_restarts"], s["steps_lost"]) == (0, 0), (seen, story(run_dir))
    assert [f["kind"] for f in s["faults"]] == kinds
    assert all(f["absorbed"] for f in s["faults"]), s["faults"]
    # every failure the log shows is absorbed, and every member's is the schedule's doing
    # (on a loaded machine a replacement starting at idle priority may miss its heartbeats
    # before it holds any slot: an observed failure too, of a non-member)
    assert all(f["absorbed"] for f in s["failures"]), s["failures"]
    assert all(f["scheduled"] for f in s["failures"] if f["member"]), s["failures"]


def _decisions(s: dict) -> list[dict]:
    return [{k: v for k, v in d.items() if k not in ("t", "event")} for d in s["decisions"]]


def test_sigstopped_worker_is_detected_within_the_horizon(
    clean_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    faults = [{"kind": "hang", "target": "r0-1", "at_step": 100, "duration_s": 3.0}]
    cfg = _config(small_dataset, faults, acceptable_pause_ms=1000)
    s = run_to_end(cfg, tmp_path)
    _assert_absorbed(s, clean_ref, ["hang"], tmp_path)
    horizon = PhiAccrual(expected_interval_s=0.1, acceptable_pause_s=1.0).horizon_s(10.0)
    leave = events(tmp_path, "leave")
    assert [e["worker"] for e in leave] == ["r0-1"] and "phi" in leave[0]["reason"]
    assert s["faults"][0]["detect_s"] <= horizon + 0.5


def test_dropped_link_reforms_the_same_members_without_changing_a_bit(
    clean_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    s = run_to_end(
        _config(small_dataset, [{"kind": "comm_error", "target": "r1-0", "at_step": 100}]), tmp_path
    )
    _assert_absorbed(s, clean_ref, ["comm_error"], tmp_path)
    assert events(tmp_path, "leave") == []
    assert s["membership_changes"] == 0


def test_a_long_delay_benches_its_member_at_once_evicts_nobody_and_plans_it_back(
    clean_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """The member is back only once its delayed heartbeats have all arrived (the fault's
    duration plus the delay) and a re-plan saw it steady: all of that must fit in the
    run's remaining steps on a fast machine too (at 14 ms a step, a 3 s delay for 4 s from
    step 60 outlasted the run's 400 steps)."""
    faults = [
        {"kind": "delay", "target": "r1-0", "at_step": 20, "delay_ms": 1500, "duration_s": 2.0}
    ]
    s = run_to_end(_config(small_dataset, faults, replan_interval_ms=500), tmp_path)
    _assert_absorbed(s, clean_ref, ["delay"], tmp_path)
    assert events(tmp_path, "leave") == []
    assert [e["worker"] for e in events(tmp_path, "member_benched")] == ["r1-0"]
    assert [e["worker"] for e in events(tmp_path, "member_unbenched")] == ["r1-0"]
    reasons = [e["reason"] for e in events(tmp_path, "epoch_announced")]
    assert reasons[1:] == ["bench", "unbench"], reasons
    members = [e["plan"]["members"] for e in events(tmp_path, "epoch_started")]
    assert "r1-0" not in members[1] and members[-1] == members[0]
    # detected by its heartbeats' lag, well before the 4 s spike ended
    assert s["faults"][0]["detect_s"] < 2.0


def test_region_loss_with_its_coordinator_is_absorbed_by_the_standby(
    clean_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    faults = [{"kind": "region_down", "target": "r0", "at_step": 100, "duration_s": 1.0}]
    s = run_to_end(_config(small_dataset, faults), tmp_path)
    _assert_absorbed(s, clean_ref, ["region_down"], tmp_path)
    assert len(events(tmp_path, "coordinator_takeover")) == 1
    reasons = [e["reason"] for e in events(tmp_path, "epoch_started")]
    # The standby's first epoch starts as announced at the takeover, or, when the region is
    # back before the lease lets the standby take over (it waits for the primary's lease to
    # expire), re-announced once after a returning member was not ready in time.
    assert reasons[0] == "start" and reasons[1] in ("takeover", "ready timeout")


def test_poisoned_part_is_quarantined_exactly_as_in_the_reference(
    poison_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    faults = [POISON, {"kind": "kill", "target": "r0-0", "at_step": 30}]
    s = run_to_end(_config(small_dataset, faults), tmp_path)
    _assert_absorbed(s, poison_ref, ["kill", "poison_part"], tmp_path)
    assert _decisions(s) == _decisions(poison_ref) != []
    assert all(d["parts"] == [3] for d in _decisions(s))


def test_resume_after_a_quarantine_reproduces_it(
    poison_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    ckpt = poison_ref["run_dir"] / "checkpoints" / "step-000000200"
    s = run_to_end(
        small_config(small_dataset, workers=2, steps=STEPS, slots=8, chaos={"faults": [POISON]}),
        tmp_path,
        resume=str(ckpt),
    )
    assert s["final_hash"] == poison_ref["final_hash"]
    assert s["decisions"] == [], "the quarantine came back with the checkpoint, not anew"
    from perdure.checkpoint import load_checkpoint

    final = load_checkpoint(tmp_path / "checkpoints" / f"step-{STEPS:09d}")
    assert final.decisions == _decisions(poison_ref)


def test_all_four_classes_in_one_run_change_no_bit(
    poison_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    faults = [
        POISON,
        {"kind": "kill", "target": "r0-1", "at_step": 80},
        {"kind": "delay", "target": "r1-0", "at_step": 120, "delay_ms": 500, "duration_s": 1.5},
        # Late enough that the benched member is back first, at 10-14 ms a step too (it
        # was not at step 250: the benched member's stale state lost 95 steps; nor, once
        # in 3 runs at 10 ms a step, at 360: its return, ~3.3 s after its bench, came 0.1 s
        # after the region's loss, and the standby re-formed from its state of step 131,
        # not the step-300 checkpoint; see the notes of issue 34's fourth pass).
        {"kind": "region_down", "target": "r0", "at_step": 392, "duration_s": 1.0},
    ]
    s = run_to_end(_config(small_dataset, faults), tmp_path, timeout_s=100)
    _assert_absorbed(s, poison_ref, ["poison_part", "kill", "delay", "region_down"], tmp_path)
    assert _decisions(s) == _decisions(poison_ref), s["faults"]


class _Outsider(threading.Thread):
    """Someone outside the chaos schedule: at given steps, sends a signal to a worker's
    current process (its pid from the run's ``join`` records), as ``kill`` from a shell."""

    def __init__(self, run_dir: Path, plan: list[tuple[int, str, int, float]]) -> None:
        super().__init__(daemon=True)
        self.run_dir, self.plan, self.sent = run_dir, plan, []

    def run(self) -> None:
        for step, worker, sig, then_cont_s in self.plan:
            while _last_step(self.run_dir) < step:
                time.sleep(0.05)
            [pid, *_] = [e["pid"] for e in reversed(events(self.run_dir, "join"))
                         if e["worker"] == worker]  # fmt: skip
            os.kill(pid, sig)
            self.sent.append((worker, pid, sig))
            if then_cont_s:
                time.sleep(then_cont_s)
                os.kill(pid, signal.SIGCONT)


def _last_step(run_dir: Path) -> int:
    from perdure.events import read_jsonl

    return max((m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")), default=-1)


def test_a_kill_and_a_stop_from_outside_the_schedule_are_observed_and_absorbed(
    clean_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """Nobody scheduled them: the summary still counts both as failures, detected and
    absorbed, with no survivor restarted and the fault-free run's bits."""
    plan = [(100, "r0-1", signal.SIGKILL, 0.0), (220, "r1-0", signal.SIGSTOP, 3.0)]
    outsider = _Outsider(tmp_path, plan)
    outsider.start()
    s = run_to_end(_config(small_dataset, [], acceptable_pause_ms=1000), tmp_path)
    outsider.join(timeout=1)
    assert len(outsider.sent) == 2
    assert s["final_hash"] == clean_ref["final_hash"], story(tmp_path)
    assert s["faults"] == []
    killed, stopped = (pid for _, pid, _ in outsider.sent)
    ours = [(f["kind"], f["worker"], f["scheduled"], f["member"]) for f in s["failures"]
            if f.get("pid") in (killed, stopped)]  # fmt: skip
    assert ours == [
        ("process_exit", "r0-1", False, True),
        ("heartbeat_loss", "r1-0", False, True),
    ], s["failures"]
    assert all(f["absorbed"] and f["detected"] for f in s["failures"]), s["failures"]
    others = [f for f in s["failures"] if f.get("pid") not in (killed, stopped)]
    assert all(f["kind"] == "heartbeat_loss" and not f["member"] for f in others), others
    assert s["failures_observed"] == s["failures_absorbed"] == s["failures_unscheduled"]
    assert s["survivor_restarts"] == 0 and s["steps_lost"] == 0
