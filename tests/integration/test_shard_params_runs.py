"""Runs with the parameters sharded at rest (``train.shard_params``): each rank keeps about
1/k of the parameters between slots and gathers the others while a slot runs, and the
final hash is still the unsharded run's, for every k and group count, through a kill of a
group's rank (``test_shard_runs.py``), a non-finite slot, and across a resume with
another k."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from perdure import events as ev
from perdure.checkpoint.reference_reader import Checkpoint
from perdure.run_config import RunConfig
from tests.runtime_support import events, run_to_end, sharded_config, small_config, summary

STEPS = 20


def _cfg(dataset: Path, workers: int, k: int, at_rest: bool = True, **kw: Any) -> RunConfig:
    return sharded_config(dataset, workers, k, steps=STEPS, at_rest=at_rest, **kw)


@pytest.fixture(scope="module")
def unsharded_run(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("unsharded") / "run"
    run_to_end(_cfg(small_dataset, 2, 1), run_dir)
    return run_dir


@pytest.fixture(scope="module")
def unsharded(unsharded_run: Path) -> str:
    return str(summary(unsharded_run)["final_hash"])


def _at_rest(run_dir: Path) -> list[dict[str, Any]]:
    return events(run_dir, ev.PARAMS_AT_REST)


@pytest.mark.parametrize(
    "workers,k,prefetch", [(2, 2, False), (4, 2, True), (6, 2, False), (3, 3, True)]
)
def test_parameters_sharded_at_rest_do_not_change_the_final_hash(
    unsharded: str, small_dataset: Path, tmp_path: Path, workers: int, k: int, prefetch: bool
) -> None:
    """With the gathers prefetched or not (``train.shard_prefetch``)."""
    run_dir = tmp_path / "run"
    cfg = _cfg(small_dataset, workers, k, train={"shard_prefetch": prefetch})
    s = run_to_end(cfg, run_dir)
    assert s["final_hash"] == unsharded
    assert s["replica_hashes_agree"]
    rest = _at_rest(run_dir)
    first = events(run_dir, ev.EPOCH_STARTED)[0]
    members, at_first = first["plan"]["members"], lambda e: e["epoch"] == first["epoch"]
    # every member of the first epoch (a loaded machine can add epochs: a member benched
    # for a moment re-plans the run without changing a bit)
    assert sorted(e["worker"] for e in rest if at_first(e)) == sorted(members)
    for e in rest:  # a rank keeps its shard: about 1/k of the parameters' bytes
        assert 0 < e["bytes"] < 1.6 * e["of"] / k, e
    peaks = events(run_dir, ev.PARAMS_PEAK)
    assert sorted(e["worker"] for e in peaks if at_first(e)) == sorted(members)
    rest_bytes = {e["worker"]: e["bytes"] for e in rest}
    for e in peaks:  # and never the whole replica's at once, gathers in flight included
        assert e["gathers"] > 0 and (e["prefetched"] > 0) == prefetch, e
        if not prefetch:
            assert e["peak_bytes"] < e["of"], e
        # prefetched: the shard and at most two units' bytes (and their 64-byte alignment;
        # on this toy model that can be the whole replica: its embedding is a third of it)
        pad = 2 * 64 * 64  # under 64 parameters a unit here
        assert e["peak_bytes"] <= rest_bytes[e["worker"]] + 2 * e["largest_unit_bytes"] + pad


@pytest.fixture(scope="module")
def at_rest_half(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step-10 checkpoint of a k = 2 run in two groups, parameters at rest."""
    first = tmp_path_factory.mktemp("at_rest") / "run"
    run_to_end(_cfg(small_dataset, 4, 2), first)
    assert not events(first, ev.CHECKPOINT_FAILED)
    return first / "checkpoints" / f"step-{STEPS // 2:09d}"


def test_each_parameter_of_a_checkpoint_is_written_by_its_shards_ranks_and_reads_whole(
    at_rest_half: Path, unsharded_run: Path
) -> None:
    """Every parameter is in the files of one shard's ranks, both shards occur, and the
    reference reader gives each model tensor with the unsharded checkpoint's bytes."""
    ckpt = Checkpoint(at_rest_half)
    manifest = ckpt.manifest
    writers = {name: int(name.split("-")[1]) for name in manifest["files"] if "tensors" in name}
    parities: set[int] = set()
    for key, rec in manifest["tensors"].items():
        if key.startswith("model/") and key.endswith("weight"):
            parity = {writers[c["file"]] % 2 for c in rec["chunks"]}
            assert len(parity) == 1, (key, parity)
            parities |= parity
    assert parities == {0, 1}
    whole = Checkpoint(unsharded_run / "checkpoints" / at_rest_half.name)
    names = [n for n in ckpt.tensor_names() if n.startswith("model/")]
    assert names == [n for n in whole.tensor_names() if n.startswith("model/")]
    for n in names:
        assert ckpt.tensor(n).tobytes() == whole.tensor(n).tobytes(), n


@pytest.mark.parametrize("workers,k,at_rest", [(2, 1, False), (4, 4, True), (2, 2, False)])
def test_a_checkpoint_sharded_at_rest_resumes_with_another_layout_on_the_same_trajectory(
    unsharded: str,
    at_rest_half: Path,
    small_dataset: Path,
    tmp_path: Path,
    workers: int,
    k: int,
    at_rest: bool,
) -> None:
    cfg = _cfg(small_dataset, workers, k, at_rest)
    s = run_to_end(cfg, tmp_path / "resumed", resume=str(at_rest_half))
    assert s["final_hash"] == unsharded


@pytest.fixture(scope="module")
def at_rest_pair(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step-10 checkpoint of a W = 2, k = 2 run, parameters at rest."""
    first = tmp_path_factory.mktemp("pair") / "run"
    run_to_end(_cfg(small_dataset, 2, 2), first)
    assert not events(first, ev.CHECKPOINT_FAILED)
    return first / "checkpoints" / f"step-{STEPS // 2:09d}"


def _tensor_bytes(ckpt: Path) -> int:
    from perdure.checkpoint.tensors import ITEMSIZE

    total = 0
    for rec in Checkpoint(ckpt).manifest["tensors"].values():
        n = ITEMSIZE[rec["dtype"]]
        for d in rec["shape"]:
            n *= d
        total += n
    return total


@pytest.mark.parametrize("workers,k,at_rest", [(3, 1, False), (1, 1, False), (3, 3, True)])
def test_a_checkpoint_of_two_ranks_in_one_group_resumes_at_any_layout_reading_by_shard(
    unsharded: str,
    at_rest_pair: Path,
    small_dataset: Path,
    tmp_path: Path,
    workers: int,
    k: int,
    at_rest: bool,
) -> None:
    """Written at W = 2, k = 2, resumed at W = 3, k = 1, at W = 1 and at W = 3, k = 3 at
    rest: the unsharded final hash. At rest, each rank read its shard's byte ranges of
    the files (and the buffers), under half the checkpoint's tensor bytes, and the
    ranks together read every tensor byte."""
    run_dir = tmp_path / "resumed"
    s = run_to_end(_cfg(small_dataset, workers, k, at_rest), run_dir, resume=str(at_rest_pair))
    assert s["final_hash"] == unsharded
    if not at_rest:
        return
    first = events(run_dir, ev.EPOCH_STARTED)[0]["epoch"]
    reads = [e["ckpt_read_bytes"] for e in _at_rest(run_dir) if e["epoch"] == first]
    total = _tensor_bytes(at_rest_pair)
    assert len(reads) == workers
    assert all(0 < r < total / 2 for r in reads), (reads, total)
    assert sum(reads) >= total, (reads, total)


def test_a_poisoned_shard_is_quarantined_with_the_unsharded_runs_decisions(
    small_dataset: Path, tmp_path: Path
) -> None:
    """The non-finite slots are re-run on other ranks than their own (the reruns hold
    the whole parameters for a moment); the quarantine and the bits are the unsharded
    run's."""
    poison = {"chaos": {"faults": [{"kind": "poison_part", "target": "3", "at_step": 5}]}}
    ref = run_to_end(_cfg(small_dataset, 2, 1, **poison), tmp_path / "ref")
    s = run_to_end(_cfg(small_dataset, 4, 2, **poison), tmp_path / "run")
    decisions = [
        [{k: v for k, v in d.items() if k != "t"} for d in r["decisions"]] for r in (ref, s)
    ]
    assert decisions[0] and decisions[1] == decisions[0]
    assert s["final_hash"] == ref["final_hash"]


def test_shard_params_without_a_replica_group_is_refused_naming_the_field() -> None:
    from perdure.config.errors import ConfigError
    from perdure.runtime.config import TrainConfig

    with pytest.raises(ConfigError, match=r"shard_params.*shard_degree > 1"):
        TrainConfig(shard_params=True)
    assert TrainConfig(shard_params=True, shard_degree=2).shard_params


@pytest.mark.parametrize(
    "train",
    [
        {"reduction": "chain"},
        {"reduction": "exact", "reduction_exponents": "carried", "reduction_bits": 64},
        {"reduction": "exact", "reduction_exponents": "streamed", "reduction_bits": 32},
        {"reduction": "exact", "precision": "bf16"},
    ],
    ids=["chain", "carried", "streamed", "bf16"],
)
def test_every_reduction_and_bf16_keep_the_bits_with_uneven_slots_per_rank(
    small_dataset: Path, tmp_path: Path, train: dict[str, Any]
) -> None:
    """3 ranks of one group share 8 slots (3, 3, 2): the third computes a throwaway slot
    to keep its gathers in step, before the reduction opens (the chain's and the carried
    exponents' own ways of starting it); the bits are the one-worker run's, in bf16 too
    (autocast's casts of a gathered parameter are its owner's bytes cast)."""
    ref = small_config(small_dataset, workers=1, steps=STEPS, train=train)
    at_rest = {**train, "shard_degree": 3, "shard_params": True}
    cfg = small_config(small_dataset, workers=3, steps=STEPS, train=at_rest)
    s, r = run_to_end(cfg, tmp_path / "run"), run_to_end(ref, tmp_path / "ref")
    assert s["final_hash"] == r["final_hash"] is not None
    plans = [e["plan"] for e in events(tmp_path / "run", ev.EPOCH_STARTED)]
    assert sorted(hi - lo for lo, hi in plans[0]["ranges"]) == [2, 3, 3], plans[0]
