"""Runs with ``train.reduction_exponents = "carried"`` (``runtime/comm/carried.py``): the
final parameters do not depend on the worker count, the region layout, a kill or a resume,
and the carried exponents travel in checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from perdure.checkpoint import load_checkpoint
from tests.runtime_support import events, run_to_end, small_config

STEPS = 30
CARRIED = {"reduction": "exact", "reduction_exponents": "carried"}


def _cfg(dataset: Path, **kw: object) -> object:
    return small_config(dataset, steps=STEPS, train=CARRIED, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def carried_ref(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("carried-ref")
    return {**run_to_end(_cfg(small_dataset, workers=1), run_dir), "run_dir": run_dir}


def test_carried_exponents_are_a_different_rounding_from_the_steps_own(
    carried_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    step = {"reduction": "exact"}
    s = run_to_end(small_config(small_dataset, workers=1, steps=STEPS, train=step), tmp_path)
    assert s["final_hash"] != carried_ref["final_hash"]


def test_the_checkpoint_carries_the_exponents_of_its_next_step(carried_ref: dict) -> None:
    half = carried_ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    exps = load_checkpoint(half).optimizer["reduction"]["exponents"]
    assert exps and all(isinstance(e, int) and -160 < e < 40 for e in exps)


@pytest.mark.parametrize("workers,regions", [(2, 1), (3, 2), (5, 2)])
def test_worker_count_and_regions_do_not_change_the_carried_runs_weights(
    carried_ref: dict, small_dataset: Path, tmp_path: Path, workers: int, regions: int
) -> None:
    s = run_to_end(_cfg(small_dataset, workers=workers, regions=regions), tmp_path)
    assert s["final_hash"] == carried_ref["final_hash"]
    refits = [e["step"] for e in events(tmp_path, "exponents_refit")]
    want = [e["step"] for e in events(carried_ref["run_dir"], "exponents_refit")]
    assert refits == want  # the same steps miss their prediction, whoever computes them


def test_a_kill_and_a_resume_do_not_change_the_carried_runs_weights(
    carried_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    kill = [{"kind": "kill", "target": "r0-1", "at_step": STEPS // 3}]
    s = run_to_end(_cfg(small_dataset, workers=3, chaos={"faults": kill}), tmp_path / "kill")
    assert s["final_hash"] == carried_ref["final_hash"]
    half = carried_ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    r = run_to_end(_cfg(small_dataset, workers=2), tmp_path / "resume", resume=str(half))
    assert r["final_hash"] == carried_ref["final_hash"]


def test_a_sharded_carried_run_gives_the_unsharded_weights(
    carried_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    sharded = {**CARRIED, "shard_degree": 2}
    cfg = small_config(small_dataset, steps=STEPS, workers=4, train=sharded)
    assert run_to_end(cfg, tmp_path)["final_hash"] == carried_ref["final_hash"]
