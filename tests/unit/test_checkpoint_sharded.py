"""A sharded optimizer state written by the ranks that hold it: each writer writes only
tensors it holds (the others reach it as ``meta`` tensors), and the checkpoint loads, and
reads with the reference reader, exactly like one written whole."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from perdure.checkpoint import load_checkpoint, save_checkpoint, state_digest
from perdure.checkpoint.errors import CheckpointSaveError
from perdure.checkpoint.plan import plan_parts
from perdure.checkpoint.reference_reader import Checkpoint
from perdure.checkpoint.state import CheckpointState
from perdure.checkpoint.tensors import Meta, flatten
from perdure.runtime.comm.transfer import pack_skeleton, unpack_skeleton
from perdure.runtime.shard_plan import merge, owners, part
from tests.checkpoint_support import ThreadExchange, make_state, same_tree
from tests.integration.test_checkpoint_parallel import assert_covers

K, WORLD = 2, 4


def _owner(state: CheckpointState) -> list[int]:
    sizes = [t.numel() for t in state.model.values()]  # any sizes: a fixed ownership
    n = len(state.optimizer["state"])
    return owners((sizes * n)[:n], K)


def _skeleton_state(whole: CheckpointState, rank: int) -> CheckpointState:
    """What rank ``rank`` of a k = 2 group passes: its shard real, the other as meta."""
    owner = _owner(whole)
    mine = rank % K
    parts = [
        part(whole.optimizer, owner, j)
        if j == mine
        else unpack_skeleton(pack_skeleton(part(whole.optimizer, owner, j))[0])
        for j in range(K)
    ]
    return CheckpointState(**{**whole.__dict__, "optimizer": merge(parts)})


def _holders(whole: CheckpointState) -> dict[str, tuple[int, ...]]:
    owner = _owner(whole)
    out: dict[str, tuple[int, ...]] = {}
    for j in range(K):
        for key in flatten({}, part(whole.optimizer, owner, j))[0]:
            if "/state/" in key:
                out[key] = tuple(r for r in range(WORLD) if r % K == j)
    return out


def _save_sharded(root: Path, whole: CheckpointState, holders: Any = None) -> list[Any]:
    ex = ThreadExchange(WORLD)
    out: list[Any] = [None] * WORLD
    holders = _holders(whole) if holders is None else holders

    def write(rank: int) -> None:
        try:
            out[rank] = save_checkpoint(
                root,
                _skeleton_state(whole, rank),
                rank=rank,
                world=WORLD,
                exchange=ex,
                holders=holders,
            )
        except Exception as e:
            out[rank] = e

    threads = [threading.Thread(target=write, args=(r,)) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return out


def test_a_sharded_state_written_by_its_holders_loads_like_the_whole_state(
    tmp_path: Path,
) -> None:
    whole = make_state(step=9)
    paths = _save_sharded(tmp_path / "sharded", whole)
    assert all(isinstance(p, Path) for p in paths) and len(set(paths)) == 1, paths
    a = load_checkpoint(paths[0])
    b = load_checkpoint(save_checkpoint(tmp_path / "whole", whole))
    assert same_tree(a.optimizer, b.optimizer) and same_tree(a.model, b.model)
    assert state_digest(a.model, a.optimizer) == state_digest(b.model, b.optimizer)
    reader = Checkpoint(paths[0])
    for key, t in flatten({}, whole.optimizer)[0].items():  # the sharded ones (fp32)
        want = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert reader.tensor(key).tobytes() == want, key


def test_each_shard_is_written_only_by_ranks_that_hold_it(tmp_path: Path) -> None:
    whole = make_state(step=9)
    path = _save_sharded(tmp_path, whole)[0]
    manifest = Checkpoint(path).manifest
    holders = _holders(whole)
    for key, rec in manifest["tensors"].items():
        ranks = {int(c["file"].split("-")[1]) for c in rec["chunks"]}
        assert ranks <= set(holders.get(key, range(WORLD))), (key, ranks)
    sizes = [(path / f).stat().st_size for f in manifest["files"] if f.endswith(".safetensors")]
    assert len(sizes) == WORLD and max(sizes) < 2 * min(sizes), sizes


def test_wrong_holders_fail_the_save_on_every_rank_and_commit_nothing(tmp_path: Path) -> None:
    whole = make_state(step=9)
    wrong = {k: tuple((r + 1) % WORLD for r in v) for k, v in _holders(whole).items()}
    out = _save_sharded(tmp_path, whole, wrong)
    assert all(isinstance(e, CheckpointSaveError) for e in out), out
    assert "does not hold" in str(out[0])
    assert list(tmp_path.iterdir()) == []  # the failed save removed its temporary directory


def test_plan_with_holders_covers_every_byte_once_on_holders_and_splits_few() -> None:
    metas = [Meta(f"m{i}", "F32", (n, 3)) for i, n in enumerate([1000, 7, 1, 500])]
    metas += [Meta(f"s{i}", "F32", (n, 3)) for i, n in enumerate([800, 3, 0, 1])]
    metas.append(Meta("scalar", "F32", ()))
    for world in (2, 4, 6):
        holders = {f"s{i}": [r for r in range(world) if r % 2 == i % 2] for i in range(4)}
        holders["scalar"] = [world - 1]
        parts = plan_parts(metas, world, holders)
        assert_covers(parts, metas)
        split = 0
        for m in metas:
            ranks = {c.rank for p in parts for c in p if c.meta.key == m.key}
            assert ranks <= set(holders.get(m.key, range(world))), m.key
            split += m.key in holders and len(ranks) > 1
        # one cut between two holders of a set splits at most one tensor: the rest map whole
        assert split <= sum(len(r) - 1 for r in {tuple(v) for v in holders.values()}), split


@pytest.mark.parametrize("bad", [[], [4], [-1]])
def test_holders_outside_the_writers_are_refused_naming_the_tensor(bad: list[int]) -> None:
    with pytest.raises(ValueError, match=r"s0: its holders must be .* \[0, 4\)"):
        plan_parts([Meta("s0", "F32", (4,))], 4, {"s0": bad})
