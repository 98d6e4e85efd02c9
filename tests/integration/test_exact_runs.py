"""Runs with ``train.reduction = "exact"``, in every form of its exponents (``step``: a MAX
round first; ``carried``: predicted per bucket from the previous step,
``runtime/comm/carried.py``; ``streamed``: predicted per block, 32-bit, each bucket on the
wire behind the backward, ``runtime/comm/streamed.py``): the final parameters do not
depend on the worker count, the region layout, a kill or a resume, and a carried run's
exponents travel in its checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from perdure.checkpoint import load_checkpoint
from perdure.runtime.comm.streamed import ZERO
from tests.runtime_support import events, run_to_end, small_config

STEPS = 30


def _train(form: str) -> dict[str, object]:
    bits = 32 if form == "streamed" else 64
    return {"reduction": "exact", "reduction_exponents": form, "reduction_bits": bits}


@pytest.fixture(scope="module", params=["step", "carried", "streamed"])
def exact_ref(
    request: pytest.FixtureRequest, small_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict:
    form = request.param
    run_dir = tmp_path_factory.mktemp(f"exact-{form}-ref")
    cfg = small_config(small_dataset, workers=1, steps=STEPS, train=_train(form))
    return {**run_to_end(cfg, run_dir), "run_dir": run_dir, "form": form}


def _cfg(ref: dict, dataset: Path, **kw: object) -> object:
    return small_config(dataset, steps=STEPS, train=_train(ref["form"]), **kw)  # type: ignore[arg-type]


def _half(ref: dict) -> Path:
    return ref["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"


def test_the_exact_reduction_is_a_different_math_from_the_chain(
    exact_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    cfg = small_config(small_dataset, workers=1, steps=STEPS, train={"reduction": "chain"})
    chain = run_to_end(cfg, tmp_path)
    assert chain["final_hash"] != exact_ref["final_hash"]


@pytest.mark.parametrize("exact_ref", ["carried", "streamed"], indirect=True)
def test_carried_exponents_are_a_different_rounding_from_the_steps_own(
    exact_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    step = small_config(small_dataset, workers=1, steps=STEPS, train=_train("step"))
    assert run_to_end(step, tmp_path)["final_hash"] != exact_ref["final_hash"]


def test_only_a_carried_runs_checkpoint_holds_the_exponents_of_its_next_step(
    exact_ref: dict,
) -> None:
    reduction = load_checkpoint(_half(exact_ref)).optimizer.get("reduction")
    if exact_ref["form"] == "step":
        assert reduction is None
        return
    exps = reduction["exponents"]
    if exact_ref["form"] == "streamed":  # one int32 per block of the slot buffer
        assert exps.dtype == torch.int32 and exps.numel() > 1
        seen = exps[exps != ZERO]
        assert seen.numel() and bool(((seen > -150) & (seen < 130)).all())
        return
    assert exps and all(isinstance(e, int) and -150 < e < 130 for e in exps)


@pytest.mark.parametrize("workers,regions", [(2, 1), (3, 2), (5, 2)])
def test_worker_count_and_regions_do_not_change_the_exact_runs_weights(
    exact_ref: dict, small_dataset: Path, tmp_path: Path, workers: int, regions: int
) -> None:
    s = run_to_end(_cfg(exact_ref, small_dataset, workers=workers, regions=regions), tmp_path)
    assert s["final_hash"] == exact_ref["final_hash"]
    # The same steps miss their prediction whoever computes them (none, in these runs).
    refits = [e["step"] for e in events(tmp_path, "exponents_refit")]
    assert refits == [e["step"] for e in events(exact_ref["run_dir"], "exponents_refit")]


def test_a_kill_and_a_resume_do_not_change_the_exact_runs_weights(
    exact_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    kill = [{"kind": "kill", "target": "r0-1", "at_step": STEPS // 3}]
    cfg = _cfg(exact_ref, small_dataset, workers=3, chaos={"faults": kill})
    assert run_to_end(cfg, tmp_path / "kill")["final_hash"] == exact_ref["final_hash"]
    r = run_to_end(
        _cfg(exact_ref, small_dataset, workers=2), tmp_path / "resume", resume=str(_half(exact_ref))
    )
    assert r["final_hash"] == exact_ref["final_hash"]


@pytest.mark.parametrize("exact_ref", ["carried", "streamed"], indirect=True)
def test_a_sharded_carried_run_gives_the_unsharded_weights(
    exact_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """(The step form's sharded runs are ``tests/integration/test_shard_runs.py``'s.)"""
    train = {**_train(exact_ref["form"]), "shard_degree": 2}
    cfg = small_config(small_dataset, steps=STEPS, workers=4, train=train)
    assert run_to_end(cfg, tmp_path)["final_hash"] == exact_ref["final_hash"]


@pytest.mark.parametrize("exact_ref", ["streamed"], indirect=True)
def test_a_kill_in_a_three_region_streamed_run_keeps_the_one_workers_weights(
    exact_ref: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """Buckets and block maxima streamed through the tiers (``comm/tiers.py``,
    ``TieredBuckets``), a region's member killed midway: the membership changes, the
    weights do not."""
    kill = [{"kind": "kill", "target": "r1-0", "at_step": STEPS // 3}]
    cfg = _cfg(exact_ref, small_dataset, workers=5, regions=3, chaos={"faults": kill})
    assert cfg.cluster.hierarchical_reduce  # type: ignore[attr-defined]
    s = run_to_end(cfg, tmp_path)
    assert s["final_hash"] == exact_ref["final_hash"] and s["replica_hashes_agree"]
    members = [e["plan"]["members"] for e in events(tmp_path, "epoch_started")]
    # The kill takes r1-0 out of the next epoch; the launcher's replacement (the same name)
    # may join again before the run ends, so the last epoch may hold it again.
    assert "r1-0" in members[0] and "r1-0" not in members[1], members
