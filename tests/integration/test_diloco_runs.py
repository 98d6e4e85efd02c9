"""DiLoCo runs (``outer.replicas``, ``runtime/replica/outer.py``): R = 4 virtual replicas
end with one final hash whatever hosts them (1, 2 or 4 workers, one region each), with a
worker or a whole region killed mid-run, a member stopped mid-step (its replicas redone,
the survivors' finished ones kept), and resumed from a mid-run checkpoint; the inner
loss goes down on tiny_lm. The exponents' step form, as ``configs/diloco.toml`` has it
(the int8 runs take the streamed default, which their all-gather does not use). int8 (its
int8 records on the wire) keeps one hash on 1 worker, 2 resumed, and 4 with one killed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from perdure.checkpoint import load_checkpoint
from perdure.events import read_jsonl
from perdure.run_config import with_overrides
from tests.runtime_support import events, run_to_end, small_config

STEPS = 8
OUTER = {"replicas": 4, "inner_steps": 2}


def _cfg(
    dataset: Path, workers: int, outer: dict = OUTER, regions: int = 0, steps: int = STEPS,
    **sections: Any,
) -> Any:  # fmt: skip
    """``workers`` in ``regions`` regions (default: one region each)."""
    train = {"reduction_exponents": "streamed" if outer.get("precision") else "step"}
    return small_config(
        dataset, workers=workers, regions=regions or workers, steps=steps, slots=4, batch=16,
        outer=outer, train=train, **sections,
    )  # fmt: skip


@pytest.fixture(scope="module")
def diloco_ref(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("diloco-ref")
    return {**run_to_end(_cfg(small_dataset, 1), run_dir), "run_dir": run_dir}


def test_one_worker_trains_the_four_replicas_and_the_inner_loss_goes_down(
    diloco_ref: dict,
) -> None:
    lines = [m for m in read_jsonl(diloco_ref["run_dir"] / "metrics.jsonl") if "loss" in m]
    assert [m["step"] for m in lines] == list(range(STEPS))
    assert all(m["inner_steps"] == 2 and m["grad_norm"] > 0 for m in lines)
    assert lines[-1]["loss"] < lines[0]["loss"] - 1.0, [m["loss"] for m in lines]
    half = load_checkpoint(diloco_ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}")
    momentum = half.optimizer["outer"]["momentum"]
    assert momentum.numel() == sum(t.numel() for t in half.model.values())
    assert half.optimizer["state"] == {}  # the inner state starts afresh every outer step


@pytest.mark.parametrize(
    "workers,regions,cross",
    [(2, 0, "auto"), (4, 0, "auto"), (4, 2, "direct"), (4, 2, "ring")],
    ids=["2", "4", "2x2-direct", "2x2-ring"],
)
def test_the_worker_and_region_count_do_not_change_the_hash(
    diloco_ref: dict, small_dataset: Path, tmp_path: Path, workers: int, regions: int, cross: str
) -> None:
    """One region a worker (the flat all-reduce), or two of two workers whose leaders
    combine by the direct exchange or by the ring (``cluster.cross_region_reduce``)."""
    cfg = _cfg(small_dataset, workers, regions=regions)
    cfg = with_overrides(cfg, cluster={"cross_region_reduce": cross})
    s = run_to_end(cfg, tmp_path)
    assert s["final_hash"] == diloco_ref["final_hash"] and s["replica_hashes_agree"]


@pytest.mark.parametrize(
    "regions,fault",
    [
        (2, {"kind": "kill", "target": "r1-0", "at_step": 3}),
        (4, {"kind": "region_down", "target": "r2", "at_step": 3}),
    ],
    ids=["worker", "region"],
)
def test_a_worker_or_region_killed_mid_run_does_not_change_the_hash(
    diloco_ref: dict, small_dataset: Path, tmp_path: Path, regions: int, fault: dict
) -> None:
    """A worker of one of two regions of two workers (the reduction in two tiers), or
    the whole region of one of four."""
    cfg = _cfg(small_dataset, 4, regions=regions, chaos={"faults": [fault]})
    s = run_to_end(cfg, tmp_path)
    assert s["final_hash"] == diloco_ref["final_hash"] and s["replica_hashes_agree"]
    members = [e["plan"]["members"] for e in events(tmp_path, "epoch_started")]
    assert fault["target"].split("-")[0] + "-0" in members[0]
    assert len(members) > 1, members  # the replicas moved to another membership


def test_a_member_stopped_mid_step_has_its_replica_redone_and_a_survivors_kept(
    diloco_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """Three members (replicas [0, 2), [2, 3), [3, 4)); the last is stopped (SIGSTOP)
    once step 3 has committed, so the others finish their replicas of step 4 and wait in
    the reduction until it is evicted: the new epoch redoes step 4 and keeps them."""
    fault = {"kind": "hang", "target": "r0-2", "at_step": 3, "duration_s": 3.0}
    cfg = _cfg(small_dataset, 3, regions=1, chaos={"faults": [fault]})
    s = run_to_end(cfg, tmp_path)
    assert s["final_hash"] == diloco_ref["final_hash"] and s["survivor_restarts"] == 0
    salvaged = events(tmp_path, "slots_salvaged")
    assert salvaged and all(e["worker"] in ("r0-0", "r0-1") for e in salvaged), salvaged


def test_a_resume_from_a_mid_run_checkpoint_retraces_the_run(
    diloco_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    half = diloco_ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    s = run_to_end(_cfg(small_dataset, 2), tmp_path, resume=str(half))
    assert s["final_hash"] == diloco_ref["final_hash"]


INT8 = {**OUTER, "precision": "int8"}


@pytest.fixture(scope="module")
def int8_ref(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("diloco-int8")
    return {**run_to_end(_cfg(small_dataset, 1, INT8), run_dir), "run_dir": run_dir}


@pytest.mark.parametrize("wire", ["zlib", "none"])
def test_int8_is_another_math_with_one_hash_on_one_worker_and_two_resumed(
    diloco_ref: dict, int8_ref: dict, small_dataset: Path, tmp_path: Path, wire: str
) -> None:
    """int8 puts int8 records on the wire (``comm/int8_gather.py``), compressed or not
    (``outer.wire_compression``, not in the hash): 1 worker, and 2 resumed from its
    step-4 checkpoint, end with one hash, not fp32's."""
    half = int8_ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    cfg = _cfg(small_dataset, 2, {**INT8, "wire_compression": wire})
    two = run_to_end(cfg, tmp_path, resume=str(half))
    assert two["final_hash"] == int8_ref["final_hash"] != diloco_ref["final_hash"]


def test_int8_on_four_workers_with_one_killed_keeps_the_one_workers_hash(
    int8_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """Two regions of two workers (the all-gather is flat over them); r1-0 dies at step
    3 and its replica moves to a survivor."""
    fault = {"kind": "kill", "target": "r1-0", "at_step": 3}
    cfg = _cfg(small_dataset, 4, INT8, regions=2, chaos={"faults": [fault]})
    s = run_to_end(cfg, tmp_path)
    assert s["final_hash"] == int8_ref["final_hash"] and s["replica_hashes_agree"]
    assert len(events(tmp_path, "epoch_started")) > 1


EF = {**INT8, "error_feedback": True}


@pytest.fixture(scope="module")
def ef_ref(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("diloco-ef")
    return {**run_to_end(_cfg(small_dataset, 1, EF), run_dir), "run_dir": run_dir}


def test_error_feedback_is_another_math_and_its_estimates_are_in_the_checkpoint(
    int8_ref: dict, ef_ref: dict
) -> None:
    assert ef_ref["final_hash"] != int8_ref["final_hash"]
    half = load_checkpoint(ef_ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}")
    est = half.optimizer["outer"]["estimates"]
    numel = sum(t.numel() for t in half.model.values())
    assert list(est.shape) == [4, numel] and all(float(e.abs().max()) > 0 for e in est)


@pytest.mark.parametrize(
    "workers,regions,fault",
    [(2, 2, None), (4, 4, {"kind": "region_down", "target": "r2", "at_step": 3})],
    ids=["two", "four-region-killed"],
)
def test_error_feedback_keeps_one_hash_on_two_workers_and_with_a_region_killed(
    ef_ref: dict, small_dataset: Path, tmp_path: Path, workers: int, regions: int,
    fault: dict | None,
) -> None:  # fmt: skip
    """The estimates are made from the records on the wire, on every member: the region
    killed takes its replica's estimate with it and the survivor that takes the replica
    over already holds the same bits."""
    chaos = {"chaos": {"faults": [fault]}} if fault else {}
    s = run_to_end(_cfg(small_dataset, workers, EF, regions=regions, **chaos), tmp_path)
    assert s["final_hash"] == ef_ref["final_hash"] and s["replica_hashes_agree"]
    if fault:
        assert len(events(tmp_path, "epoch_started")) > 1


def test_error_feedback_resumed_from_a_mid_run_checkpoint_retraces_the_run(
    ef_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    half = ef_ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    s = run_to_end(_cfg(small_dataset, 2, EF), tmp_path, resume=str(half))
    assert s["final_hash"] == ef_ref["final_hash"]


DELAYED = {**OUTER, "delay": 1}
DELAYED_EF = {**EF, "delay": 1}


@pytest.fixture(scope="module")
def delay_ref(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("diloco-delay")
    return {**run_to_end(_cfg(small_dataset, 1, DELAYED), run_dir), "run_dir": run_dir}


def test_a_delayed_outer_step_is_another_math_with_one_hash_on_one_worker_and_two_resumed(
    diloco_ref: dict, delay_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """``outer.delay = 1``: the mean not yet applied travels in the checkpoint, so two
    workers resumed from one worker's step-4 checkpoint end with its hash. The checkpoint
    was due while step 3's reduction ran behind step 4's replicas: the save waited for it
    (the reduction settles first), so the mean it holds is step 3's."""
    assert delay_ref["final_hash"] != diloco_ref["final_hash"]
    half = delay_ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    assert float(load_checkpoint(half).optimizer["outer"]["pending"].abs().max()) > 0
    two = run_to_end(_cfg(small_dataset, 2, DELAYED), tmp_path, resume=str(half))
    assert two["final_hash"] == delay_ref["final_hash"]


@pytest.mark.parametrize("outer", [DELAYED, DELAYED_EF], ids=["fp32", "int8-ef"])
def test_a_worker_killed_while_the_outer_reduction_is_in_flight_does_not_change_the_hash(
    delay_ref: dict, small_dataset: Path, tmp_path_factory: pytest.TempPathFactory,
    outer: dict,
) -> None:  # fmt: skip
    """The overlapped form of ``outer.delay = 1``: an outer step's reduction runs behind
    the next step's replicas. r1-0's sends are held 1.5 s (``delay``; the bench threshold
    raised above it, so nobody is benched), so at any moment a reduction it has not sent
    to is in flight, longer than the kill takes to land even on a loaded machine, and it
    is killed after step 3: the survivors undo the update of the step whose reduction was
    lost (``outer_undone``), redo that step in the next epoch with their own replicas kept,
    and end with the one worker's hash (int8 with error feedback: its estimates too)."""
    ref = delay_ref
    if outer is DELAYED_EF:
        ref_dir = tmp_path_factory.mktemp("diloco-delay-ef")
        ref = run_to_end(_cfg(small_dataset, 1, outer), ref_dir)
    faults = [
        {"kind": "delay", "target": "r1-0", "at_step": 0, "delay_ms": 1500, "duration_s": 60},
        {"kind": "kill", "target": "r1-0", "at_step": 3},
    ]
    run_dir = tmp_path_factory.mktemp("killed")
    cfg = _cfg(small_dataset, 4, outer, regions=2, chaos={"faults": faults},
               cluster={"bench_lag_ms": 10_000})  # fmt: skip
    s = run_to_end(cfg, run_dir)
    assert s["final_hash"] == ref["final_hash"] and s["replica_hashes_agree"]
    undone = events(run_dir, "outer_undone")
    assert undone and {e["worker"] for e in undone} <= {"r0-0", "r0-1", "r1-1"}, undone
    assert all(e["step"] >= 3 for e in undone), undone


LEAVE_STEPS = 32
"""The leave's boundary lies past every member's reported step by up to 20 steps of margin
(``boundary.planned_boundary``): before the run's end."""
"""The leave's run: a leave asked for at step 2 must land mid-run even when the 2 cores
are loaded (on 8 steps, a clean-clone CI saw the leave reach the coordinator at the last
step, its boundary past the end; with CPU hogs beside it, not before the end at all)."""


def test_a_member_leaving_at_a_step_boundary_settles_the_outer_reductions_before_it(
    small_dataset: Path, tmp_path: Path
) -> None:
    """r1-0's sends are held 400 ms, so an outer reduction is in flight at any moment, and
    it is stopped after step 2 (SIGTERM: it leaves at the next step boundary ``after``,
    and a new process joins under its name later). Every step before the boundary is
    settled, whoever was in flight (its reduction is waited for, not abandoned); a member
    that had already applied a step at or past the boundary undoes it (that step belongs
    to the next epoch), so the next epoch starts at the boundary and the run ends with
    the one worker's hash."""
    faults = [
        {"kind": "delay", "target": "r1-0", "at_step": 0, "delay_ms": 400, "duration_s": 60},
        {"kind": "stop", "target": "r1-0", "at_step": 2, "duration_s": 1.0},
    ]
    one = run_to_end(_cfg(small_dataset, 1, DELAYED, steps=LEAVE_STEPS), tmp_path / "one")
    cfg = _cfg(small_dataset, 4, DELAYED, regions=2, steps=LEAVE_STEPS, chaos={"faults": faults})
    run_dir = tmp_path / "four"
    s = run_to_end(cfg, run_dir)
    assert s["final_hash"] == one["final_hash"] and s["replica_hashes_agree"]
    (leave,) = [e for e in events(run_dir, "epoch_announced") if "gracefully" in e["reason"]]
    after = leave["after"]
    assert 2 < after < LEAVE_STEPS, leave  # mid-run: else nothing to settle before it
    assert [(e["worker"], e["next_step"]) for e in events(run_dir, "left")] == [("r1-0", after)]
    (started,) = [e for e in events(run_dir, "epoch_started") if e["epoch"] == leave["epoch"]]
    assert started["start_step"] == after
    assert all(e["step"] >= after for e in events(run_dir, "outer_undone"))
