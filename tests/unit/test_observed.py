"""Failures read back from a run's log, scheduled or not: each counted once, matched to
the fault that explains it, and judged detected and absorbed."""

from __future__ import annotations

from typing import Any

from perdure import events as ev
from perdure.chaos.observed import failure_totals, observed_failures

Record = dict[str, Any]


def _e(t: float, event: str, **kw: Any) -> Record:
    return {"t": t, "event": event, **kw}


def _start(t: float, epoch: int, members: list[str], step: int) -> Record:
    return _e(t, ev.EPOCH_STARTED, epoch=epoch, start_step=step, plan={"members": members})


def _metrics(until: float) -> list[Record]:
    return [{"t": 0.1 * i, "step": i, "step_s": 0.1} for i in range(int(until * 10))]


BASE = [
    _e(0.0, ev.JOIN, worker="a-0", region="a", pid=10),
    _e(0.0, ev.JOIN, worker="a-1", region="a", pid=11),
    _e(0.0, ev.JOIN, worker="b-0", region="b", pid=12),
    _start(0.05, 0, ["a-0", "a-1", "b-0"], 0),
]


def _kill(t: float, worker: str, *, injected: bool = False) -> list[Record]:
    """What a SIGKILL leaves: the coordinator's leave, the survivors' failed collectives,
    a new epoch, the launcher's exit record (a little later)."""
    return [
        _e(t, ev.LEAVE, worker=worker, reason="connection closed (process exited)"),
        _e(t + 0.001, ev.COLLECTIVE_FAILED, worker="b-0", epoch=0, error="reset"),
        _start(t + 0.01, 1, ["a-0", "b-0"], int(t * 10) + 1),
        _e(t + 0.05, ev.PROCESS_EXIT, worker=worker, code=-9, injected=injected),
    ]


def test_an_unscheduled_kill_is_one_failure_detected_and_absorbed() -> None:
    log = [*BASE, *_kill(2.0, "a-1"), _e(9.0, ev.RUN_END)]
    [f] = observed_failures(log, _metrics(9))
    assert (f["kind"], f["worker"], f["pid"], f["t"]) == ("process_exit", "a-1", 11, 2.0)
    assert not f["scheduled"] and f["detected"] and f["absorbed"] and f["member"]
    assert f["detected_by"] == ev.LEAVE and f["steps_lost"] == 0 and f["recover_s"] is not None


def test_a_kill_the_schedule_injected_is_matched_by_pid() -> None:
    fault = _e(1.99, ev.FAULT_INJECTED, fault=0, kind="kill", target="a-1", pids=[11])
    log = [*BASE, fault, *_kill(2.0, "a-1", injected=True), _e(9.0, ev.RUN_END)]
    [f] = observed_failures(log, _metrics(9))
    assert f["scheduled"] and f["fault"] == 0


def test_a_stopped_worker_is_a_heartbeat_loss_and_its_return_no_failure() -> None:
    log = [
        *BASE,
        _e(3.0, ev.LEAVE, worker="b-0", reason="phi > 10.0 (no heartbeat)"),
        _start(3.01, 1, ["a-0", "a-1"], 31),
        _e(6.0, ev.COLLECTIVE_FAILED, worker="b-0", epoch=0, error="stale epoch"),
        _e(6.1, ev.JOIN, worker="b-0", region="b", pid=12),
        _start(6.3, 2, ["a-0", "a-1", "b-0"], 64),
        _e(9.0, ev.RUN_END),
    ]
    [f] = observed_failures(log, _metrics(9))
    assert (f["kind"], f["worker"], f["pid"]) == ("heartbeat_loss", "b-0", 12)
    assert f["absorbed"] and not f["scheduled"]


def test_a_stopped_member_benched_before_phi_fails_as_a_member_when_it_was_benched() -> None:
    log = [
        *BASE,
        _e(2.5, ev.MEMBER_BENCHED, worker="b-0", lag_s=0.51),
        _start(2.51, 1, ["a-0", "a-1"], 26),
        _e(3.0, ev.LEAVE, worker="b-0", reason="phi > 10.0 (no heartbeat)"),
        _e(6.1, ev.JOIN, worker="b-0", region="b", pid=12),
        _start(6.3, 2, ["a-0", "a-1", "b-0"], 64),
        _e(9.0, ev.RUN_END),
    ]
    [f] = observed_failures(log, _metrics(9))
    assert (f["kind"], f["worker"], f["t"], f["member"]) == ("heartbeat_loss", "b-0", 2.5, True)
    assert f["detected_by"] == ev.MEMBER_BENCHED and f["absorbed"]


def test_a_collective_failure_nobody_died_in_is_a_failure_of_its_own() -> None:
    fault = _e(1.0, ev.FAULT_INJECTED, fault=0, kind="comm_error", target="b-0", pids=[])
    log = [
        *BASE,
        fault,
        _e(1.2, ev.COLLECTIVE_FAILED, worker="a-0", epoch=0, error="link"),
        _e(1.2, ev.COLLECTIVE_FAILED, worker="b-0", epoch=0, error="link"),
        _start(1.3, 1, ["a-0", "a-1", "b-0"], 14),
        _e(9.0, ev.RUN_END),
    ]
    [f] = observed_failures(log, _metrics(9))
    assert f["kind"] == "collective_failure" and f["reporters"] == ["a-0", "b-0"]
    assert f["scheduled"] and f["fault"] == 0  # the target is one of the reporters


def test_a_graceful_leave_and_what_follows_the_run_end_are_no_failures() -> None:
    log = [
        *BASE,
        _e(2.0, ev.LEAVE_REQUESTED, worker="a-1"),
        _e(2.5, ev.LEAVE, worker="a-1", reason="connection closed (process exited)"),
        _e(9.0, ev.RUN_END),
        _e(9.1, ev.LEAVE, worker="a-0", reason="connection closed (process exited)"),
    ]
    assert observed_failures(log, _metrics(9)) == []


def test_a_failure_before_the_end_that_never_came_is_not_absorbed() -> None:
    [f] = observed_failures([*BASE, *_kill(2.0, "a-1")], _metrics(3))
    assert f["detected"] and not f["absorbed"]


def test_a_survivor_that_crashed_while_the_run_recovered_counts_as_a_survivor_restart() -> None:
    crash = _e(2.005, ev.PROCESS_EXIT, worker="b-0", code=1, injected=False)
    log = [*BASE, *_kill(2.0, "a-1"), crash, _e(9.0, ev.RUN_END)]
    failures = observed_failures(log, _metrics(9))
    assert [(f["worker"], f["survivor"]) for f in failures] == [("a-1", False), ("b-0", True)]
    totals = failure_totals(failures)
    assert totals["survivor_restarts"] == 1 and totals["failures_observed"] == 2


def test_workers_lost_with_their_coordinator_are_detected_by_the_epoch_without_them() -> None:
    fault = _e(2.0, ev.FAULT_INJECTED, fault=0, kind="region_down", target="a", pids=[10, 11])
    log = [
        *BASE,
        fault,
        _e(2.05, ev.PROCESS_EXIT, worker="a-1", code=-9, injected=True),
        _e(2.06, ev.COORDINATOR_TAKEOVER, by="standby"),
        _e(2.07, ev.PROCESS_EXIT, worker="a-0", code=-9, injected=True),
        _start(2.5, 1, ["b-0"], 26),
        _e(9.0, ev.RUN_END),
    ]
    failures = observed_failures(log, _metrics(9))
    assert [(f["kind"], f["worker"]) for f in failures] == [
        ("process_exit", "a-1"),
        ("coordinator_loss", "coordinator"),
        ("process_exit", "a-0"),
    ]
    assert all(f["scheduled"] and f["detected"] and f["absorbed"] for f in failures), failures
    assert failures[0]["detected_by"] == ev.EPOCH_STARTED


def test_a_worker_lost_with_the_coordinator_is_detected_by_an_epoch_of_its_replacement() -> None:
    """The standby takes over only after the primary's lease expired: by then the launcher's
    replacement (same name, another process) may be back, and is in the first epoch."""
    fault = _e(2.0, ev.FAULT_INJECTED, fault=0, kind="region_down", target="a", pids=[10])
    log = [
        *BASE,
        fault,
        _e(2.05, ev.PROCESS_EXIT, worker="a-0", code=-9, injected=True),
        _e(2.9, ev.JOIN, worker="a-0", region="a", pid=20),
        _e(3.0, ev.COORDINATOR_TAKEOVER, by="standby", generation=2),
        _start(3.5, 1, ["a-0", "a-1", "b-0"], 35),
        _e(9.0, ev.RUN_END),
    ]
    exits = [f for f in observed_failures(log, _metrics(9)) if f["kind"] == "process_exit"]
    assert [(f["worker"], f["detected_by"], f["absorbed"]) for f in exits] == [
        ("a-0", ev.EPOCH_STARTED, True)
    ]
    log.remove(log[-4])  # no replacement joined: the old process "is" the member
    exits = [f for f in observed_failures(log, _metrics(9)) if f["kind"] == "process_exit"]
    assert not exits[0]["detected"]
