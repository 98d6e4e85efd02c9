"""A user's recipe is honoured: own group rates, own scheduler, mean losses, compiled
models; and the recipe and dataset are part of the run's identity."""

from __future__ import annotations

from pathlib import Path

import pytest

from perdure.launch.preflight import PreflightError, preflight
from perdure.runtime.replica.recipe import Recipe
from perdure.runtime.replica.task import build_task
from perdure.runtime.replica.trainer import Trainer
from tests.runtime_support import build_small_dataset, run_to_end, small_config

STEPS = 20


def _cfg(dataset: Path, entry: str, options: dict | None = None, **sections: dict) -> object:
    task = {"entry": f"tests.recipe_task:{entry}", "options": options or {}}
    return small_config(dataset, workers=1, steps=STEPS, task=task, **sections)


def _hash(config: object) -> str:
    trainer = Trainer(config)  # type: ignore[arg-type]
    try:
        return trainer.config_hash
    finally:
        trainer.close()


def test_the_config_schedule_keeps_a_custom_optimizers_group_ratio(small_dataset: Path) -> None:
    optim = {"schedule": "cosine", "warmup_steps": 5, "min_lr_ratio": 0.1}
    cfg = _cfg(small_dataset, "two_groups", optim=optim)
    recipe = Recipe(build_task(cfg.task, 0), cfg.optim, STEPS)
    seen = []
    for step in range(STEPS):
        recipe.set_lr(step)
        fast, slow = (g["lr"] for g in recipe.optimizer.param_groups)
        assert fast / slow == pytest.approx(10.0, rel=1e-12)
        seen.append(fast)
    assert seen[0] == pytest.approx(1e-3 / 5) and seen[5] == pytest.approx(1e-3)
    assert seen[-1] < seen[5]  # the cosine decays each group's own rate


def test_a_changed_custom_optimizer_is_a_changed_run(small_dataset: Path) -> None:
    a = _hash(_cfg(small_dataset, "two_groups"))
    b = _hash(_cfg(small_dataset, "two_groups", {"weight_decay": 0.01}))
    assert a != b and a == _hash(_cfg(small_dataset, "two_groups"))


def test_a_changed_dataset_is_a_changed_run(small_dataset: Path, tmp_path: Path) -> None:
    import sysconfig

    from perdure.data import build_dataset

    other = tmp_path / "other"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    build_dataset([str(stdlib / "json")], str(other), seq_len=64, part_mb=0.05, include="*.py")
    base = small_config(small_dataset, workers=1)
    moved = small_config(other, workers=1)
    assert _hash(base) != _hash(moved)
    copy = build_small_dataset(tmp_path / "copy")  # same content elsewhere: the same run
    assert _hash(small_config(copy, workers=1)) == _hash(base)


def test_a_schedulers_state_survives_a_resume_bitwise(small_dataset: Path, tmp_path: Path) -> None:
    from perdure.checkpoint import load_checkpoint

    own = {"schedule": "constant", "warmup_steps": 0}
    cfg = _cfg(small_dataset, "with_scheduler", checkpoint={"every_steps": STEPS // 2}, optim=own)
    whole = run_to_end(cfg, tmp_path / "whole")
    half = tmp_path / "whole" / "checkpoints" / f"step-{STEPS // 2:09d}"
    sched = load_checkpoint(half).optimizer["scheduler"]
    assert sched["last_epoch"] == STEPS // 2 and sched["_last_lr"] == [cfg.optim.lr * 0.5**2]
    resumed = run_to_end(cfg, tmp_path / "resumed", resume=str(half))
    assert resumed["steps"] == STEPS // 2 and resumed["final_hash"] == whole["final_hash"]


def test_a_scheduler_and_a_config_schedule_together_are_refused(small_dataset: Path) -> None:
    cfg = _cfg(small_dataset, "with_scheduler", optim={"schedule": "constant", "warmup_steps": 3})
    with pytest.raises(PreflightError, match=r"optim\.schedule: the task brings its own") as e:
        preflight(cfg)
    assert "(got {'schedule': 'constant', 'warmup_steps': 3})" in str(e.value)


def test_a_mean_loss_declared_as_such_trains_at_the_sums_scale(
    small_dataset: Path, tmp_path: Path
) -> None:
    from perdure.events import read_jsonl
    from tests.runtime_support import summary

    mean = run_to_end(_cfg(small_dataset, "mean_loss", optim={"warmup_steps": 0}), tmp_path / "m")
    plain = small_config(small_dataset, workers=1, steps=STEPS, optim={"warmup_steps": 0})
    ref = run_to_end(plain, tmp_path / "s")
    assert mean["steps"] == ref["steps"] == STEPS
    first = [read_jsonl(tmp_path / d / "metrics.jsonl")[0]["loss"] for d in ("m", "s")]
    assert first[0] == pytest.approx(first[1], rel=1e-5)
    assert summary(tmp_path / "m")["final_hash"] is not None


@pytest.mark.parametrize(
    ("entry", "options", "declared", "measured"),
    [("mean_loss", {"declare": "sum"}, "sum", "mean"), ("sum_declared_as_mean", {}, "mean", "sum")],
)
def test_a_loss_that_is_not_what_the_task_declares_is_refused_before_workers_start(
    small_dataset: Path, entry: str, options: dict, declared: str, measured: str
) -> None:
    with pytest.raises(PreflightError) as e:
        preflight(_cfg(small_dataset, entry, options))
    text = str(e.value)
    assert "task.loss_reduction" in text
    assert f"declares {declared!r} but its loss_fn returns the {measured}" in text


def test_a_compiled_model_checkpoints_with_the_plain_modules_keys(small_dataset: Path) -> None:
    compiled = Trainer(_cfg(small_dataset, "compiled"))
    eager = Trainer(small_config(small_dataset, workers=1, steps=STEPS))
    try:
        state = compiled.checkpoint_state({}).model
        assert list(state) == list(eager.checkpoint_state({}).model)
        eager.module.load_state_dict(state)  # the eager model reads the compiled one's state
        assert compiled.fingerprint_names() == eager.fingerprint_names()
    finally:
        compiled.close()
        eager.close()


def test_the_preflight_computes_the_same_run_hash_as_every_worker(small_dataset: Path) -> None:
    from perdure.run_config import config_hash

    cfg = _cfg(small_dataset, "two_groups")
    report = preflight(cfg)
    assert report.identity is not None
    assert config_hash(cfg, report.identity) == _hash(cfg) != config_hash(cfg)


def test_the_logged_rate_of_each_group_is_the_task_schedulers_at_every_step(
    small_dataset: Path, tmp_path: Path
) -> None:
    """OneCycleLR over two named groups: ``lr/<group>`` in metrics.jsonl, TensorBoard's
    points and the Prometheus snapshot are the rates the optimizer used, not optim.lr."""
    from perdure.events import read_jsonl
    from perdure.metrics.tensorboard import train_points
    from perdure.metrics.view import snapshot
    from tests.recipe_task import one_cycle

    own = {"schedule": "constant", "warmup_steps": 0}
    run_to_end(_cfg(small_dataset, "one_cycle", {"total_steps": STEPS}, optim=own), tmp_path)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    task = one_cycle(STEPS)
    assert task.make_optimizer is not None and task.make_scheduler is not None
    opt = task.make_optimizer(task.model.parameters(), None)
    sched = task.make_scheduler(opt)
    expected = []
    for _ in range(STEPS):  # the rates each step uses, then the scheduler's step
        expected.append({f"lr/{g['name']}": g["lr"] for g in opt.param_groups})
        opt.step()
        sched.step()
    got = [{k: v for k, v in m.items() if k.startswith("lr/")} for m in metrics]
    assert [m["step"] for m in metrics] == list(range(STEPS))
    assert got == expected  # exact: the same floats
    assert [m["lr"] for m in metrics] == [e["lr/body"] for e in expected]
    assert len({e["lr/body"] for e in expected}) == STEPS  # the schedule really moves
    tags = {p.tag for p in train_points(metrics)}
    assert {"train/lr/body", "train/lr/embeddings"} <= tags
    snap = snapshot(metrics, [], [])
    assert snap.lrs == {k[3:]: v for k, v in expected[-1].items()}
    from perdure.metrics.prometheus import RunCollector

    [family] = [f for f in RunCollector(lambda: snap, lambda: True, "primary", STEPS).collect()
                if f.name == "perdure_group_learning_rate"]  # fmt: skip
    assert {s.labels["group"]: s.value for s in family.samples} == snap.lrs
