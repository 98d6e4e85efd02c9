"""The chaos driver: a monitor hook that fires each fault at its trigger and undoes timed
ones after their duration, through any ClusterControl."""

from __future__ import annotations

import signal
from typing import Any

from perdure import events as ev
from perdure.chaos.config import ChaosConfig, FaultConfig
from perdure.chaos.driver import RETRY_S, ChaosDriver
from perdure.launch.base import Progress
from tests.chaos_support import FakeControl


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _driver(*faults: dict[str, Any], alive: dict[str, str] | None = None) -> Any:
    control = FakeControl(alive=alive or {"a-0": "a", "a-1": "a"})
    clock = Clock()
    schedule = ChaosConfig(faults=[FaultConfig(**f) for f in faults])
    return ChaosDriver(schedule, control, clock=clock), control, clock


def _events(control: FakeControl, name: str) -> list[dict[str, Any]]:
    return [r for r in control.records if r["event"] == name]


def test_a_step_trigger_fires_once_when_the_run_reaches_its_step() -> None:
    d, c, _ = _driver({"kind": "kill", "target": "a-1", "at_step": 5})
    c.now = Progress(step=4, first_step_t=90.0)
    d.tick()
    assert c.records == []
    c.now = Progress(step=7, first_step_t=90.0)
    d.tick()
    d.tick()
    (rec,) = _events(c, ev.FAULT_INJECTED)
    assert rec == {
        "t": 100.0, "event": ev.FAULT_INJECTED, "fault": 0, "kind": "kill", "target": "a-1",
        "step": 7, "at_step": 5, "pids": [1001],
    }  # fmt: skip
    assert d.done


def test_a_time_trigger_counts_from_the_first_committed_step() -> None:
    d, c, clock = _driver({"kind": "hang", "target": "a-0", "at_s": 2.0, "duration_s": 1.0})
    d.tick()  # no step yet
    c.now = Progress(step=0, first_step_t=99.0)
    d.tick()
    assert c.records == []
    clock.t = 101.0
    d.tick()
    assert [x[2] for x in c.calls] == [signal.SIGSTOP]
    clock.t = 101.5
    d.tick()
    assert not _events(c, ev.FAULT_ENDED)
    clock.t = 102.0
    d.tick()
    assert [x[2] for x in c.calls] == [signal.SIGSTOP, signal.SIGCONT]
    (ended,) = _events(c, ev.FAULT_ENDED)
    assert ended == {"event": ev.FAULT_ENDED, "fault": 0, "kind": "hang", "target": "a-0"}
    assert d.done


def test_an_undo_that_cannot_happen_yet_is_retried() -> None:
    d, c, clock = _driver({"kind": "stop", "target": "a-0", "at_step": 0, "duration_s": 1.0})
    c.restart_ok = [False, False]
    c.now = Progress(step=0, first_step_t=100.0)
    d.tick()
    for dt in (1.0, 1.0 + RETRY_S, 1.0 + 2 * RETRY_S):
        clock.t = 100.0 + dt
        d.tick()
    assert [x for x in c.calls if x[0] == "restart"] == [("restart", "a-0", ok) for ok in
                                                          (False, False, True)]  # fmt: skip
    assert len(_events(c, ev.FAULT_ENDED)) == 1 and d.done


def test_untimed_kinds_are_never_undone_and_a_region_without_duration_stays_down() -> None:
    d, c, clock = _driver(
        {"kind": "kill", "target": "a-0", "at_step": 0, "duration_s": 1.0},
        {"kind": "region_down", "target": "a", "at_step": 0},
    )
    c.now = Progress(step=0, first_step_t=100.0)
    d.tick()
    clock.t = 1e9
    d.tick()
    assert _events(c, ev.FAULT_ENDED) == [] and c.vetoed == {"a"} and d.done


def test_faults_due_in_one_tick_fire_in_schedule_order() -> None:
    d, c, _ = _driver(
        {"kind": "comm_error", "target": "a-1", "at_step": 3},
        {"kind": "delay", "target": "a", "at_step": 2, "delay_ms": 10, "duration_s": 1.0},
    )
    c.now = Progress(step=3, first_step_t=100.0)
    d.tick()
    assert [r["fault"] for r in _events(c, ev.FAULT_INJECTED)] == [0, 1]
    assert set(c.posted) == {"chaos/a-1", "chaos/a"}
