"""Runs with ``train.reduction = "exact"``: the final parameters do not depend on the worker
count, the region layout, a kill or a resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.runtime_support import run_to_end, small_config

STEPS = 30
EXACT = {"reduction": "exact"}


def _cfg(dataset: Path, **kw: object) -> object:
    return small_config(dataset, steps=STEPS, train=EXACT, **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def exact_ref(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("exact-ref")
    return {**run_to_end(_cfg(small_dataset, workers=1), run_dir), "run_dir": run_dir}


def test_the_exact_reduction_is_a_different_math_from_the_chain(
    exact_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    chain = run_to_end(small_config(small_dataset, workers=1, steps=STEPS), tmp_path)
    assert chain["final_hash"] != exact_ref["final_hash"]


@pytest.mark.parametrize("workers,regions", [(2, 1), (3, 2), (5, 2)])
def test_worker_count_and_regions_do_not_change_the_exact_runs_weights(
    exact_ref: dict, small_dataset: Path, tmp_path: Path, workers: int, regions: int
) -> None:
    s = run_to_end(_cfg(small_dataset, workers=workers, regions=regions), tmp_path)
    assert s["final_hash"] == exact_ref["final_hash"]


def test_a_kill_and_a_resume_do_not_change_the_exact_runs_weights(
    exact_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    kill = [{"kind": "kill", "target": "r0-1", "at_step": STEPS // 3}]
    s = run_to_end(_cfg(small_dataset, workers=3, chaos={"faults": kill}), tmp_path / "kill")
    assert s["final_hash"] == exact_ref["final_hash"]
    half = exact_ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    r = run_to_end(_cfg(small_dataset, workers=2), tmp_path / "resume", resume=str(half))
    assert r["final_hash"] == exact_ref["final_hash"]
