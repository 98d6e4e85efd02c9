"""The fault registry: one class per kind, the only kind-to-class map, and what each kind
validates, injects, undoes and recognises in the event log."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, get_args

import pytest

from perdure import events as ev
from perdure.chaos import faults
from perdure.chaos.config import FaultConfig
from perdure.chaos.faults.base import FailureClass, Target
from perdure.chaos.summary import fault_report
from perdure.config import ConfigError
from perdure.report.tables import derived_fault_rows
from tests.chaos_support import FakeControl

ROOT = Path(__file__).resolve().parents[2]
CLASSES = {  # the design's kinds; the registry may hold more (a new kind is one new module)
    "kill": "hardware",
    "stop": "planned",
    "hang": "hardware",
    "comm_error": "hardware",
    "delay": "network",
    "region_down": "partial_cluster_loss",
    "poison_part": "data",
}


def test_the_registry_holds_each_kind_once_in_a_module_of_its_name() -> None:
    assert {k: faults.REGISTRY[k].failure_class for k in CLASSES} == CLASSES
    for kind, fault in faults.REGISTRY.items():
        assert type(fault).__module__ == f"perdure.chaos.faults.{kind}"
        assert fault.failure_class in get_args(FailureClass)
        assert fault.target in get_args(Target)
        assert type(fault).__doc__, f"{kind}: the docstring is its config documentation"
    assert {"comm_error", "delay"} <= faults.in_process_kinds()
    assert not {"kill", "hang", "stop", "region_down", "poison_part"} & faults.in_process_kinds()


def test_the_report_reads_its_classes_from_the_registry() -> None:
    rows = derived_fault_rows(
        [{"t": 1.0, "event": ev.FAULT_INJECTED, "kind": k, "target": "x"} for k in CLASSES]
    )
    assert {r["kind"]: r["class"] for r in rows} == CLASSES  # stop included: one map
    assert faults.failure_class("meteor") is None


def test_the_registry_the_summary_and_the_report_import_without_torch() -> None:
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import perdure.chaos.driver, perdure.chaos.summary, perdure.report, perdure.chaos.config\n"
        "from perdure.chaos import faults; assert len(faults.REGISTRY) >= 7\n"
    )
    env = {"PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


# -- a new kind is one module ---------------------------------------------------------------


def _package(tmp_path: Path, name: str, modules: dict[str, str]) -> Any:
    pkg = tmp_path / name
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for mod, src in modules.items():
        (pkg / f"{mod}.py").write_text(textwrap.dedent(src))
    sys.path.insert(0, str(tmp_path))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(tmp_path))


_NEW_KIND = """
    import signal
    from perdure.chaos.faults.base import Fault

    class Pause(Fault):
        '''SIGTSTP a worker.'''
        kind = "pause"
        failure_class = "hardware"
        target = "worker"

        def inject(self, fault, control):
            return control.signal(fault.target, signal.SIGTSTP)
"""


def test_a_module_dropped_into_the_package_is_a_new_kind(tmp_path: Path) -> None:
    pkg = _package(tmp_path, "newkinds", {"pause": _NEW_KIND, "_helpers": "X = 1\n"})
    found = faults.discover(pkg)
    assert list(found) == ["pause"] and found["pause"].failure_class == "hardware"


def test_a_module_with_two_kinds_fails_at_import(tmp_path: Path) -> None:
    two = _NEW_KIND + "\n    class Other(Pause):\n        kind = 'other'\n"
    pkg = _package(tmp_path, "twokinds", {"pause": two})
    with pytest.raises(ImportError, match="expected one Fault subclass, found 2"):
        faults.discover(pkg)


# -- validate --------------------------------------------------------------------------------


def _problems(**fields: Any) -> list[tuple[str, str, object]]:
    with pytest.raises(ConfigError) as e:
        FaultConfig(**fields)
    return [(p.key, p.rule, p.value) for p in e.value.problems]


def test_an_unknown_kind_is_reported_with_the_registered_kinds() -> None:
    assert _problems(kind="meteor", target="a-0", at_step=1) == [
        ("kind", f"must be one of {list(faults.kinds())}", "meteor")
    ]


def test_each_kind_checks_its_own_fields() -> None:
    assert _problems(kind="kill", target="a0", at_step=1) == [
        ("target", "must be a worker name REGION-INDEX", "a0")
    ]
    assert _problems(kind="delay", target="a", at_step=1) == [
        ("delay_ms", "must be a finite number > 0", 0)
    ]
    rule = "poison_part needs a step trigger (the reference run must poison the same samples)"
    assert _problems(kind="poison_part", target="x", at_s=1.0) == [
        ("target", "must be a dataset part index", "x"),
        ("at_step", rule, 1.0),
    ]


def test_shared_rules_are_reported_with_the_kinds_rules() -> None:
    assert _problems(kind="hang", target="a0", duration_s=0) == [
        ("at_step", "exactly one of at_step, at_s must be set", None),
        ("duration_s", "must be a finite number > 0", 0),
        ("target", "must be a worker name REGION-INDEX", "a0"),
    ]


# -- inject and undo -------------------------------------------------------------------------


def _fault(kind: str, target: str, **extra: Any) -> FaultConfig:
    return FaultConfig(kind=kind, target=target, at_step=1, **extra)


def test_signal_kinds_send_their_signals_and_mark_deaths_as_expected() -> None:
    c = FakeControl(alive={"a-0": "a"})
    assert faults.REGISTRY["kill"].inject(_fault("kill", "a-0"), c) == [1000]
    assert faults.REGISTRY["stop"].inject(_fault("stop", "a-0"), c) == [1000]
    assert faults.REGISTRY["hang"].inject(_fault("hang", "a-0"), c) == [1000]
    assert faults.REGISTRY["hang"].undo(_fault("hang", "a-0"), c)
    assert c.calls == [
        ("signal", "a-0", signal.SIGKILL, True),
        ("signal", "a-0", signal.SIGTERM, False),
        ("signal", "a-0", signal.SIGSTOP, False),
        ("signal", "a-0", signal.SIGCONT, False),
    ]


def test_a_stopped_worker_comes_back_only_once_it_has_left() -> None:
    c = FakeControl(restart_ok=[False])
    stop = faults.REGISTRY["stop"]
    assert stop.undo(_fault("stop", "a-0"), c) is False
    assert stop.undo(_fault("stop", "a-0"), c) is True
    assert c.calls == [("restart", "a-0", False), ("restart", "a-0", True)]


def test_region_down_kills_the_region_coordinator_included_and_vetoes_replacements() -> None:
    c = FakeControl(alive={"a-0": "a", "a-1": "a", "b-0": "b", "coordinator": "a"})
    down = faults.REGISTRY["region_down"]
    assert down.inject(_fault("region_down", "a"), c) == [1000, 1001, 1003]
    assert {call[1] for call in c.calls} == {"a-0", "a-1", "coordinator"}
    assert all(call[2:] == (signal.SIGKILL, True) for call in c.calls)
    assert c.vetoed == {"a"}
    assert down.undo(_fault("region_down", "a"), c) and c.vetoed == set()


def test_in_process_kinds_are_posted_under_their_targets_key() -> None:
    import json

    c = FakeControl()
    assert faults.REGISTRY["delay"].inject(_fault("delay", "b", delay_ms=50, duration_s=2), c) == []
    assert faults.REGISTRY["comm_error"].inject(_fault("comm_error", "a-0"), c) == []
    delay, comm = json.loads(c.posted["chaos/b"]), json.loads(c.posted["chaos/a-0"])
    assert (delay["kind"], delay["delay_ms"], delay["duration_s"]) == ("delay", 50, 2)
    assert comm["kind"] == "comm_error" and comm["seq"] > delay["seq"] > 0
    assert c.calls == []


def test_a_poisoned_part_is_left_to_the_loaders() -> None:
    c = FakeControl()
    assert faults.REGISTRY["poison_part"].inject(_fault("poison_part", "3"), c) == []
    assert c.calls == [] and c.posted == {}


# -- detection in the event log --------------------------------------------------------------


def _log(kind: str, target: str, sign: dict[str, Any]) -> tuple[list, list]:
    events = [
        {"t": 1.0, "event": ev.JOIN, "worker": "a-0", "region": "a"},
        {"t": 1.0, "event": ev.JOIN, "worker": "b-0", "region": "b"},
        {"t": 10.0, "event": ev.FAULT_INJECTED, "fault": 0, "kind": kind, "target": target,
         "step": 5, "at_step": 5},
        {"t": 10.25, **sign},
        {"t": 10.5, "event": ev.EPOCH_STARTED, "start_step": 6},
        {"t": 10.75, "event": ev.STATE_RECEIVED, "seconds": 0.125},
        {"t": 20.0, "event": ev.RUN_END},
    ]  # fmt: skip
    metrics = [{"t": 9.0 + i / 2, "step": i + 3, "step_s": 0.1} for i in range(6)]
    return events, metrics


@pytest.mark.parametrize(
    ("kind", "target", "sign"),
    [
        ("kill", "a-0", {"event": ev.LEAVE, "worker": "a-0"}),
        ("hang", "a-0", {"event": ev.LEAVE, "worker": "a-0"}),
        ("stop", "a-0", {"event": ev.LEAVE_REQUESTED, "worker": "a-0"}),
        ("comm_error", "a-0", {"event": ev.COLLECTIVE_FAILED, "worker": "b-0"}),
        ("region_down", "a", {"event": ev.LEAVE, "worker": "a-0"}),
        ("region_down", "a", {"event": ev.COORDINATOR_TAKEOVER}),
        ("delay", "b-0", {"event": ev.EPOCH_ANNOUNCED, "reason": "rebalance"}),
    ],
)
def test_each_kind_recognises_its_detection(kind: str, target: str, sign: dict) -> None:
    (row,) = fault_report(*_log(kind, target, sign))
    assert (row["class"], row["detect_s"], row["replan_s"]) == (CLASSES[kind], 0.25, 0.5)
    copies = kind in ("kill", "hang", "stop", "region_down")
    assert row["state_copy_s"] == (0.125 if copies else None)
    assert row["absorbed"] is True


def test_another_workers_leave_is_not_a_kills_detection() -> None:
    (row,) = fault_report(*_log("kill", "a-0", {"event": ev.LEAVE, "worker": "b-0"}))
    assert row["detect_s"] is None and row["absorbed"] is False


def test_a_delay_that_evicts_its_target_is_not_absorbed() -> None:
    (row,) = fault_report(*_log("delay", "b-0", {"event": ev.LEAVE, "worker": "b-0"}))
    assert row["absorbed"] is False


def test_a_poisoned_part_starts_with_its_step_and_is_seen_as_a_quarantine() -> None:
    events, metrics = _log("poison_part", "3", {"event": ev.DECISION, "parts": [3]})
    (row,) = fault_report(events, metrics)
    # step 4 (the one before at_step 5) committed at t = 9.5: the loaders poisoned step 5 then
    assert row["injected_t"] == 9.5 and row["detect_s"] == 0.75
    assert row["replan_s"] is None and row["state_copy_s"] is None and row["absorbed"]


def test_a_kind_this_code_does_not_know_is_read_as_one_that_removes_members() -> None:
    (row,) = fault_report(*_log("meteor", "a-0", {"event": ev.LEAVE, "worker": "a-0"}))
    assert row["class"] == "other" and row["detect_s"] == 0.25 and row["absorbed"]
