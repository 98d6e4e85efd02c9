"""Buffers that a forward changes follow one rule, whoever computes which slot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from perdure.launch.local import RunFailed
from perdure.runtime.replica.buffers import BufferRule
from perdure.runtime.replica.slots import SlotEngine
from tests.buffer_task import BufferLM, loss_fn
from tests.runtime_support import events, run_to_end, small_config

STEPS = 24
TASK = {"entry": "tests.buffer_task:make_task", "options": {"d": 16}}


def _config(dataset: Path, workers: int, **sections: dict) -> object:
    return small_config(dataset, workers=workers, steps=STEPS, task=TASK, **sections)


@pytest.fixture(scope="module")
def one_worker(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("bn1") / "run"
    return {**run_to_end(_config(small_dataset, 1), run_dir), "run_dir": run_dir}


def _batch(n: int = 4, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"tokens": torch.randint(0, 256, (n, 9), generator=g), "weight": torch.ones(n)}


def test_a_slot_leaves_the_buffers_as_the_step_began_and_records_its_move() -> None:
    torch.manual_seed(0)
    model = BufferLM()
    engine = SlotEngine(model, loss_fn, seed=1, slots=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = engine.new_buffer()
    engine.compute(0, 1, _batch(), out)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    moves = engine.layout.buffer_moves(out)
    offsets, at = {}, 0
    for name, b in engine.buffers.buffers:
        offsets[name], at = at, at + b.numel()
    assert moves[offsets["tally.seen"]] == 4 and moves[offsets["bn1.num_batches_tracked"]] == 1
    mean = offsets["bn1.running_mean"]
    assert bool(moves[mean : mean + 16].abs().sum() > 0)  # the batch statistics moved it


def test_float_buffers_move_by_the_mean_and_counters_by_the_sum_of_the_slots() -> None:
    model = BufferLM()
    rule = BufferRule(model)
    moves = torch.zeros(rule.numel)
    offset = 0
    for name, b in rule.buffers:
        moves[offset : offset + b.numel()] = 3.0 if name.endswith(("seen", "tracked")) else 0.5
        offset += b.numel()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    rule.apply(moves, slots=2)
    now = model.state_dict()
    assert int(now["tally.seen"]) == int(start["tally.seen"]) + 3
    assert int(now["bn2.num_batches_tracked"]) == 3
    assert torch.equal(now["bn1.running_mean"], start["bn1.running_mean"] + 0.25)


@pytest.mark.parametrize("workers", [2, 3])
def test_batchnorm_and_own_buffers_end_bitwise_equal_for_any_worker_count(
    one_worker: dict, small_dataset: Path, tmp_path: Path, workers: int
) -> None:
    s = run_to_end(_config(small_dataset, workers), tmp_path / "run")
    assert s["replica_hashes_agree"] and s["final_hash"] == one_worker["final_hash"]


def test_a_killed_worker_does_not_change_the_buffers(
    one_worker: dict, small_dataset: Path, tmp_path: Path
) -> None:
    chaos = {"faults": [{"kind": "kill", "target": "r0-1", "at_step": STEPS // 2}]}
    s = run_to_end(_config(small_dataset, 3, chaos=chaos), tmp_path / "run")
    assert s["replica_hashes_agree"] and s["final_hash"] == one_worker["final_hash"]
    assert s["survivor_restarts"] == 0
    # every process's liveness lock was made, then removed: by the coordinator that saw
    # the killed one released by the kernel, by each other worker as it finished
    alive = tmp_path / "run" / "control" / "alive"
    assert alive.is_dir() and list(alive.iterdir()) == []


def test_the_final_checkpoint_counts_every_slots_batch(one_worker: dict) -> None:
    from perdure.checkpoint import latest_checkpoint, load_checkpoint

    ckpt = latest_checkpoint(one_worker["run_dir"] / "checkpoints")
    assert ckpt is not None
    model = load_checkpoint(ckpt).model
    slots, batch = 8, 16
    assert int(model["bn1.num_batches_tracked"]) == STEPS * slots
    assert int(model["tally.seen"]) == STEPS * batch


def test_replicas_whose_state_differs_with_no_majority_fail_the_run_naming_the_tensor(
    small_dataset: Path, tmp_path: Path
) -> None:
    task = {"entry": "tests.buffer_task:make_diverging_task", "options": {"d": 16}}
    cfg = small_config(
        small_dataset, workers=2, steps=STEPS, task=task, cluster={"fingerprint_every": 5}
    )
    with pytest.raises(RunFailed, match=r"no majority agrees; tensors that differ: marker"):
        run_to_end(cfg, tmp_path / "run")
    [diverged, *_] = events(tmp_path / "run", "replica_diverged")
    assert diverged["tensors"] == ["marker"] and diverged["step"] == 5


def test_with_the_exact_reduction_buffers_are_equal_for_one_and_three_workers(
    small_dataset: Path, tmp_path: Path
) -> None:
    exact = {"reduction": "exact"}
    one = run_to_end(_config(small_dataset, 1, train=exact), tmp_path / "one")
    three = run_to_end(_config(small_dataset, 3, train=exact), tmp_path / "three")
    assert three["replica_hashes_agree"] and one["final_hash"] == three["final_hash"]
