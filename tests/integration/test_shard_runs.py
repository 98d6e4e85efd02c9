"""Runs with replica groups (``train.shard_degree``): the same final hash as the unsharded
run with the exact reduction, for every k and group count, through a kill of a group's
rank, and across a resume with another k."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from perdure import events as ev
from perdure.checkpoint.reference_reader import Checkpoint
from perdure.events import read_jsonl
from perdure.run_config import RunConfig
from tests.runtime_support import events, run_to_end, small_config

STEPS = 20


def _cfg(dataset: Path, workers: int, k: int, at_rest: bool = False, **kw: Any) -> RunConfig:
    train = {"reduction": "exact", "shard_degree": k, "shard_params": at_rest}
    return small_config(dataset, workers=workers, steps=STEPS, train=train, **kw)


@pytest.fixture(scope="module")
def unsharded(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    s = run_to_end(_cfg(small_dataset, 2, 1), tmp_path_factory.mktemp("unsharded") / "run")
    return str(s["final_hash"])


@pytest.mark.parametrize("workers,k", [(2, 2), (4, 2), (6, 2)])
def test_the_shard_degree_and_the_group_count_do_not_change_the_final_hash(
    unsharded: str, small_dataset: Path, tmp_path: Path, workers: int, k: int
) -> None:
    s = run_to_end(_cfg(small_dataset, workers, k), tmp_path / "run")
    assert s["final_hash"] == unsharded
    assert s["replica_hashes_agree"]


CLIP = {"grad_clip": 0.05}  # below the gradient's norm: every step is clipped


@pytest.fixture(scope="module")
def unsharded_clipped(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    run_dir = tmp_path_factory.mktemp("unsharded_clipped") / "run"
    return str(run_to_end(_cfg(small_dataset, 2, 1, optim=CLIP), run_dir)["final_hash"])


@pytest.mark.parametrize(
    "mode,workers,k,at_rest,regions",
    [
        ("scatter", 4, 2, False, 1),
        ("whole", 4, 2, False, 1),
        ("auto", 6, 3, True, 1),
        ("auto", 4, 2, False, 2),  # a group per region; the tail and exponents in tiers
    ],
)
def test_the_reduce_scatter_and_the_whole_reduction_end_with_the_unsharded_bits(
    unsharded_clipped: str,
    small_dataset: Path,
    tmp_path: Path,
    mode: str,
    workers: int,
    k: int,
    at_rest: bool,
    regions: int,
) -> None:
    """Clipped at every step, so a rank's norms summed over its group must give the whole
    gradient's norm bit for bit; each shard's range of the buffer is one run, the same for
    its ranks in every group, and the ranges tile the gradient part in shard order."""
    run_dir = tmp_path / "run"
    train = {"reduction": "exact", "shard_degree": k, "shard_params": at_rest, "shard_reduce": mode}
    cfg = small_config(
        small_dataset, workers=workers, regions=regions, steps=STEPS, train=train, optim=CLIP
    )
    s = run_to_end(cfg, run_dir)
    assert s["final_hash"] == unsharded_clipped
    logged = events(run_dir, ev.SHARD_REDUCE)
    first = events(run_dir, ev.EPOCH_STARTED)[0]
    members = first["plan"]["members"]  # (a loaded machine can add epochs: bits unchanged)
    logged = [e for e in logged if e["epoch"] == first["epoch"]]
    assert sorted(e["worker"] for e in logged) == sorted(members)
    want = "whole" if mode == "whole" else "scatter"
    assert {e["mode"] for e in logged} == {want} and {e["why"] for e in logged} == {None}
    if want == "scatter":
        by_shard = {members.index(e["worker"]) % k: tuple(e["range"]) for e in logged}
        assert all(tuple(e["range"]) == by_shard[members.index(e["worker"]) % k] for e in logged)
        ranges = [by_shard[j] for j in range(k)]
        assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
        assert all(lo < hi for lo, hi in ranges)


def test_a_scatter_with_a_reduction_that_cannot_scatter_is_refused_naming_the_field() -> None:
    from perdure.config.errors import ConfigError
    from perdure.runtime.config import TrainConfig

    with pytest.raises(ConfigError, match=r"shard_reduce.*'scatter' needs train.reduction"):
        TrainConfig(shard_degree=2, shard_reduce="scatter", reduction="chain")
    assert not TrainConfig(shard_degree=2, reduction="chain").scatters  # auto: whole
    assert TrainConfig(shard_degree=2).scatters  # the default reduction is exact
    carried = {"reduction": "exact", "reduction_exponents": "carried", "reduction_bits": 64}
    assert TrainConfig(shard_degree=2, shard_reduce="scatter", **carried).scatters  # type: ignore[arg-type]
    assert not TrainConfig(shard_degree=2, shard_reduce="whole", **carried).scatters  # type: ignore[arg-type]


@pytest.mark.parametrize("form", ["carried", "streamed"])
def test_the_carried_form_reduce_scattered_ends_with_its_unsharded_bits(
    small_dataset: Path, tmp_path: Path, form: str
) -> None:
    """``reduction_exponents = "carried"`` or ``"streamed"`` (one slot buffer and the
    accumulator a rank, whatever its slots; streamed: each bucket reduce-scattered behind
    the backward) in two groups of two, reduce-scattered, clipped at every step."""
    hashes = []
    bits = {"reduction_bits": 32 if form == "streamed" else 64}
    for workers, k in ((2, 1), (4, 2)):
        train = {"reduction": "exact", "reduction_exponents": form, "shard_degree": k, **bits}
        cfg = small_config(small_dataset, workers=workers, steps=STEPS, train=train, optim=CLIP)
        run_dir = tmp_path / f"k{k}"
        hashes.append(run_to_end(cfg, run_dir)["final_hash"])
    assert hashes[1] == hashes[0]
    first = events(run_dir, ev.EPOCH_STARTED)[0]["epoch"]
    modes = {
        e["worker"]: e["mode"] for e in events(run_dir, ev.SHARD_REDUCE) if e["epoch"] == first
    }
    assert modes == {f"r0-{i}": "scatter" for i in range(4)}


@pytest.mark.parametrize("at_rest", [False, True], ids=["whole_params", "params_at_rest"])
def test_a_killed_rank_of_a_group_is_absorbed_and_changes_no_bit(
    unsharded: str, small_dataset: Path, tmp_path: Path, at_rest: bool
) -> None:
    """r0-0 (rank 0 of group 0) killed: the next epoch takes two of the three survivors
    (whole groups only) that hold both shards between them, whose shards may have to move
    (r0-1 held shard 1 and is rank 0 now); the third waits for a partner. With the
    parameters sharded at rest (``train.shard_params``), r0-0's parameters existed only on
    it and on the other group's rank 0: a survivor that moves to another shard receives
    that shard's parameters with its optimizer state."""
    kill = [{"kind": "kill", "target": "r0-0", "at_step": STEPS // 3}]
    run_dir = tmp_path / "run"
    s = run_to_end(_cfg(small_dataset, 4, 2, at_rest, chaos={"faults": kill}), run_dir)
    assert s["final_hash"] == unsharded
    assert sorted(m["step"] for m in read_jsonl(run_dir / "metrics.jsonl")) == list(range(STEPS))
    leaves = events(run_dir, ev.LEAVE)
    assert [e["worker"] for e in leaves] == ["r0-0"], leaves  # a failure shows the reasons
    sizes = [len(e["plan"]["members"]) for e in events(run_dir, ev.EPOCH_STARTED)]
    assert sizes[:2] == [4, 2] and all(n % 2 == 0 for n in sizes)  # whole groups only
    plans = {e["epoch"]: e["plan"]["members"] for e in events(run_dir, ev.EPOCH_STARTED)}
    moved = events(run_dir, ev.SHARD_RECEIVED)
    regrouped = [e for e in events(run_dir, ev.EPOCH_ANNOUNCED) if "regrouped" in e["reason"]]
    # r0-1 and r0-2 swap shards, unless r0-1's update was torn (r0-0 died during the
    # parameters' exchange): then the epoch is regrouped as r0-2 and r0-3, whose shards fit.
    assert moved or regrouped
    for got in moved:  # each from a member, for its position
        members = plans[got["epoch"]]
        assert got["shard"] == members.index(got["worker"]) % 2, got
        assert got["from"] in members and got["from"] != got["worker"] and got["bytes"] > 0
    if at_rest:  # a rank keeps less than the whole in every later epoch
        later = [e for e in events(run_dir, ev.PARAMS_AT_REST) if e["epoch"] > 0]
        assert later and all(e["bytes"] < e["of"] for e in later)


@pytest.mark.parametrize("at_rest", [False, True], ids=["whole_params", "params_at_rest"])
def test_a_spare_replacing_a_killed_rank_copies_only_its_own_shard_from_its_holders(
    unsharded: str, small_dataset: Path, tmp_path: Path, at_rest: bool
) -> None:
    """4 ranks in two groups and a warm spare; r0-1 (shard 1 of group 0) is killed. The
    spare takes its place and shard, copies the state from the live holder of that shard
    (not the coordinator's source), so the exchange gives it nothing: the bytes it
    received are its shard's, fewer than a whole replica's; the final hash is unchanged.

    The kill waits for 3/5 of the run: the spare is promoted only once it is prepared (its
    trainer built, its warm-up slot run), and in a clean-clone CI beside another test's
    run it was not yet at step 6: the killed rank's replacement took its place instead."""
    kill = [{"kind": "kill", "target": "r0-1", "at_step": STEPS * 3 // 5}]
    run_dir = tmp_path / "run"
    cfg = _cfg(small_dataset, 4, 2, at_rest, cluster={"spares": 1}, chaos={"faults": kill})
    s = run_to_end(cfg, run_dir)
    assert s["final_hash"] == unsharded
    plans = {e["epoch"]: e for e in events(run_dir, ev.EPOCH_STARTED)}
    got = [e for e in events(run_dir, ev.STATE_RECEIVED) if e["worker"] == "spare-0"]
    assert len(got) == 1, got
    # (r0-0 may receive too: its update torn when r0-1 died during the parameters' exchange)
    epoch = next(e for e in plans.values() if "spare-0" in e["receivers"])
    members = epoch["plan"]["members"]
    shard = members.index("spare-0") % 2
    assert members.index(epoch["source"]) % 2 != shard  # the source holds the other shard
    assert members.index(got[0]["from"]) % 2 == shard
    assert got[0]["refetched"] == 0 and set(got[0]["holders"]) <= set(members) - {"spare-0"}
    # the survivors compute the epoch's first step while it copies, where the parameters
    # are whole on every rank (copy_rule); sharded at rest, every member waits for it
    assert got[0]["mode"] == ("blocking" if at_rest else "overlapped"), got
    assert got[0]["overlapped_step"] == (None if at_rest else epoch["start_step"]), got
    assert not [e for e in events(run_dir, ev.SHARD_RECEIVED) if e["worker"] == "spare-0"]
    from perdure.runtime.replica.trainer import Trainer

    tr = Trainer(cfg, cache_dir=str(tmp_path / "cache"))
    try:  # a whole replica: the model's state and AdamW's two moments of every parameter
        model = sum(t.numel() * t.element_size() for t in tr.module.state_dict().values())
        params = sum(p.numel() * p.element_size() for p in tr.module.parameters())
    finally:
        tr.close()
    assert 0 < got[0]["bytes"] < 0.9 * (model + 2 * params)


@pytest.fixture(scope="module")
def sharded_half(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The step-10 checkpoint of a k = 2 run in two groups: each rank wrote part of its
    own shard's optimizer state, nothing gathered."""
    first = tmp_path_factory.mktemp("sharded") / "run"
    run_to_end(_cfg(small_dataset, 4, 2), first)
    assert not events(first, ev.CHECKPOINT_FAILED)
    return first / "checkpoints" / f"step-{STEPS // 2:09d}"


def test_a_periodic_checkpoint_of_a_sharded_run_is_written_by_each_shards_owners(
    sharded_half: Path,
) -> None:
    """Every optimizer-state tensor of a parameter is in the files of one shard's ranks
    (rank % 2 equal), both shards occur, and every rank wrote a part."""
    manifest = Checkpoint(sharded_half).manifest
    writers = {name: int(name.split("-")[1]) for name in manifest["files"] if "tensors" in name}
    assert sorted(writers.values()) == [0, 1, 2, 3]
    shards = {}
    for key, rec in manifest["tensors"].items():
        if key.startswith("optimizer/state/"):
            index = key.split("/")[2]
            parity = {writers[c["file"]] % 2 for c in rec["chunks"]}
            assert len(parity) == 1, (key, parity)
            assert shards.setdefault(index, parity) == parity, key
    assert {p for v in shards.values() for p in v} == {0, 1}
    assert Checkpoint(sharded_half).context()["topology"]["shard_degree"] == 2


@pytest.mark.parametrize("workers,k", [(2, 1), (4, 4)])
def test_a_sharded_checkpoint_resumes_with_another_shard_degree_on_the_same_trajectory(
    unsharded: str, sharded_half: Path, small_dataset: Path, tmp_path: Path, workers: int, k: int
) -> None:
    s = run_to_end(_cfg(small_dataset, workers, k), tmp_path / "resumed", resume=str(sharded_half))
    assert s["final_hash"] == unsharded
