"""The user's randomness: a loss that draws from numpy's global generator, from
``perdure.slot_generator()`` or from Python's ``random`` is a function of (seed, step, slot),
so runs with it end bitwise equal whatever the membership, a kill or a resume; a generator
the task holds, which perdure cannot seed, stops the slot with its name."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

import perdure
from perdure.checkpoint import load_checkpoint
from perdure.runtime.replica.slots import SlotEngine
from perdure.runtime.replica.task import Task
from perdure.runtime.replica.user_rng import UncontrolledRandomness, seed_globals, seed_torch
from tests.random_task import make_task
from tests.runtime_support import events, run_to_end, small_config

SLOTS = 4
STEPS = 16


def _batch(slot: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + slot)
    return {"tokens": torch.randint(0, 256, (2, 17), generator=g), "weight": torch.ones(2)}


def _engine(source: str) -> tuple[Task, SlotEngine]:
    seed_globals(7)
    task = make_task(source)
    return task, SlotEngine(task.model, task.loss_fn, seed=7, slots=SLOTS)


@pytest.mark.parametrize("source", ["numpy", "generator", "python"])
def test_a_slot_drawing_from_a_user_generator_is_the_same_whatever_ran_before_it(
    source: str,
) -> None:
    _, fresh = _engine(source)
    alone = fresh.new_buffer()
    fresh.compute(5, 2, _batch(2), alone)
    _, busy = _engine(source)
    for slot in range(SLOTS):  # another history: other slots, other draws in between
        busy.compute(3, slot, _batch(slot), busy.new_buffer())
        np.random.random(17), random.random(), torch.rand(3)
    np.random.seed(12345), random.seed(999)
    after = busy.new_buffer()
    busy.compute(5, 2, _batch(2), after)
    assert torch.equal(alone, after)


@pytest.mark.parametrize("source", ["numpy", "generator", "python"])
def test_the_draws_depend_on_the_slot_and_the_step(source: str) -> None:
    """The generator really feeds the loss: another (step, slot) gives other draws."""
    seed_globals(7)
    task = make_task(source, dropout=0.0)  # only the user's draws can tell the slots apart
    engine = SlotEngine(task.model, task.loss_fn, seed=7, slots=SLOTS)
    losses = [engine.compute(step, 1, _batch(1), engine.new_buffer()) for step in (0, 0, 1)]
    assert losses[0] == losses[1] != losses[2]


def test_seed_torch_leaves_the_cpu_generator_where_torch_manual_seed_does() -> None:
    for seed in (0, 7, 2**63 - 1):
        torch.manual_seed(seed)
        want = torch.get_rng_state()
        torch.manual_seed(seed + 1)
        seed_torch(seed)
        assert torch.equal(torch.get_rng_state(), want)
        assert torch.initial_seed() == seed


def test_a_slot_leaves_every_global_generator_as_it_found_it() -> None:
    _, engine = _engine("all")
    torch.manual_seed(1), np.random.seed(2), random.seed(3)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    engine.compute(0, 0, _batch(0), engine.new_buffer())
    assert torch.equal(torch.get_rng_state(), before[0])
    assert np.array_equal(np.random.get_state()[1], before[1])
    assert random.getstate() == before[2]


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("own_numpy", r"global 'OWN_RNG' of module 'tests\.random_task' \(numpy\.random\."),
        ("own_python", r"closure variable 'own_python' .*\(random\.Random\)"),
        ("own_torch", r"generator 'model\.gen' \(torch\.Generator\)"),
    ],
)
def test_a_generator_the_task_holds_is_refused_by_name_when_it_moves(
    source: str, named: str
) -> None:
    _, engine = _engine(source)
    with pytest.raises(UncontrolledRandomness, match=named + r".* slot 1 of step 4"):
        engine.compute(4, 1, _batch(1), engine.new_buffer())


def test_slot_generator_exists_only_inside_a_slot() -> None:
    with pytest.raises(RuntimeError, match="outside a slot"):
        perdure.slot_generator()


def _config(ds: Path, workers: int, source: str = "all", **sections: object) -> object:
    task = {"entry": "tests.random_task:make_task", "options": {"source": source}}
    return small_config(ds, workers=workers, steps=STEPS, task=task, **sections)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def reference(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    run_dir = tmp_path_factory.mktemp("user-rng-ref")
    return {**run_to_end(_config(small_dataset, 1), run_dir), "run_dir": run_dir}  # type: ignore[arg-type]


def test_a_run_drawing_from_every_user_generator_survives_a_kill_bitwise(
    reference: dict, small_dataset: Path, tmp_path: Path
) -> None:
    faults = [{"kind": "kill", "target": "r1-0", "at_step": STEPS // 3}]
    cfg = small_config(small_dataset, workers=3, regions=2, steps=STEPS, cluster={"spares": 1},
                       chaos={"faults": faults},
                       task={"entry": "tests.random_task:make_task"})  # fmt: skip
    s = run_to_end(cfg, tmp_path)
    assert [e["worker"] for e in events(tmp_path, "leave")] == ["r1-0"]
    assert s["final_hash"] == reference["final_hash"]


def test_a_resume_of_a_run_drawing_from_every_user_generator_is_bitwise(
    reference: dict, small_dataset: Path, tmp_path: Path
) -> None:
    half = reference["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    s = run_to_end(_config(small_dataset, 2), tmp_path, resume=str(half))  # type: ignore[arg-type]
    assert s["final_hash"] == reference["final_hash"]
    mine = load_checkpoint(tmp_path / "checkpoints" / f"step-{STEPS:09d}")
    theirs = load_checkpoint(reference["run_dir"] / "checkpoints" / f"step-{STEPS:09d}")
    assert mine.rng == theirs.rng  # `ckpt diff` finds no rng difference
    assert mine.rng["slots"]["seeded"][:4] == ["torch_cpu", "torch_cuda", "numpy_global",
                                               "python_random"]  # fmt: skip


def test_a_run_whose_loss_draws_from_its_own_generator_is_refused_naming_it(
    small_dataset: Path, tmp_path: Path
) -> None:
    """Refused by the launcher's preflight, which runs the loss once before any worker."""
    from perdure.launch.preflight import PreflightError

    with pytest.raises(PreflightError, match=r"global 'OWN_RNG' .* changed state"):
        run_to_end(_config(small_dataset, 1, "own_numpy"), tmp_path)  # type: ignore[arg-type]
