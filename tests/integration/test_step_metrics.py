"""The gradient norm of every committed step (issue 36 item 2): ``grad_norm`` in
metrics.jsonl is the norm before ``optim.grad_clip`` (what ``clip_grad_norm_`` returns),
computed without a clip too, the same bits on any worker count and in replica groups, and
it reaches TensorBoard's points, the snapshot and Prometheus. The task's own metrics
(issue 36 item 3): ``loss_fn`` returns ``(loss, {"accuracy": ...})`` (``Task.metrics``),
reduced like the loss, the same bits on any worker count, logged to every sink, and the
training's bits unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from perdure.events import read_jsonl
from perdure.runtime.replica.task import split_loss
from tests.image_task import import_digits
from tests.runtime_support import run_to_end, sharded_config, small_config

STEPS = 8


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return import_digits(tmp_path_factory.mktemp("digits"), 640)


def _sections(clip: float | None) -> dict[str, Any]:
    return {
        "task": {"entry": "tests.image_task:make_task", "options": {}},
        "optim": {"lr": 0.02, "warmup_steps": 1, "grad_clip": clip},
    }


def _run(cfg: Any, run_dir: Path) -> tuple[str, list[float]]:
    s = run_to_end(cfg, run_dir)
    assert s["steps"] == STEPS
    metrics = list(read_jsonl(run_dir / "metrics.jsonl"))
    assert [m["step"] for m in metrics] == list(range(STEPS))
    return s["final_hash"], [m["grad_norm"] for m in metrics]


@pytest.fixture(scope="module")
def unclipped(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, list]:
    cfg = small_config(dataset, workers=1, steps=STEPS, batch=32, **_sections(None))
    return _run(cfg, tmp_path_factory.mktemp("unclipped"))


def test_the_norm_is_logged_without_a_clip_and_equals_a_clip_that_never_bites(
    unclipped: tuple[str, list], dataset: Path, tmp_path: Path
) -> None:
    """Two workers with grad_clip = 1e9 (a coefficient of 1: the same bits) log the
    one-worker unclipped run's norms, bit for bit, and end with its hash."""
    final, norms = unclipped
    assert all(isinstance(n, float) and n > 0 for n in norms)
    cfg = small_config(dataset, workers=2, steps=STEPS, batch=32, **_sections(1e9))
    assert _run(cfg, tmp_path) == (final, norms)


def test_a_clipped_run_logs_the_norm_before_the_clip(
    unclipped: tuple[str, list], dataset: Path, tmp_path: Path
) -> None:
    final, norms = unclipped
    clip = norms[0] / 2
    cfg = small_config(dataset, workers=1, steps=STEPS, batch=32, **_sections(clip))
    got_final, got = _run(cfg, tmp_path)
    assert got[0] == norms[0] and got_final != final  # the same gradient, then clipped


def test_replica_groups_log_the_same_norm_from_their_scattered_gradients(
    unclipped: tuple[str, list], dataset: Path, tmp_path: Path
) -> None:
    """Sharded (each rank reduces a range; the norm is all-reduced, as the clip's)."""
    cfg = sharded_config(dataset, 2, 2, steps=STEPS, at_rest=False,
                         train={"global_batch": 32}, **_sections(None))  # fmt: skip
    assert _run(cfg, tmp_path) == unclipped


def test_the_norm_reaches_tensorboard_the_snapshot_and_prometheus(
    unclipped: tuple[str, list],
) -> None:
    from perdure.metrics.prometheus import RunCollector
    from perdure.metrics.tensorboard import train_points
    from perdure.metrics.view import snapshot

    _, norms = unclipped
    metrics = [{"step": i, "t": float(i), "loss": 1.0, "grad_norm": n} for i, n in enumerate(norms)]
    points = [p for p in train_points(metrics) if p.tag == "train/grad_norm"]
    assert [(p.step, p.value) for p in points] == list(enumerate(norms))
    snap = snapshot(metrics, [], [])
    assert snap.grad_norm == norms[-1]
    [family] = [f for f in RunCollector(lambda: snap, lambda: True, "primary", STEPS).collect()
                if f.name == "perdure_grad_norm"]  # fmt: skip
    assert [s.value for s in family.samples] == [norms[-1]]


def _with_accuracy(dataset: Path, workers: int) -> Any:
    """With an evaluation every 4 steps (its loss_fn's tuple read there too)."""
    sections = _sections(None)
    sections["task"]["options"] = {"accuracy": True}
    sections["eval"] = {"every_steps": 4, "dataset": str(dataset), "samples": 64}
    return small_config(dataset, workers=workers, steps=STEPS, batch=32, **sections)


@pytest.fixture(scope="module")
def accuracy_run(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("accuracy")
    run_to_end(_with_accuracy(dataset, 1), run_dir)
    return run_dir


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    return [m for m in read_jsonl(run_dir / "metrics.jsonl") if "eval_step" not in m]


def _accuracy(run_dir: Path) -> list[float]:
    return [m["train/accuracy"] for m in _steps(run_dir)]


def test_a_metric_returned_by_the_loss_is_logged_per_step_without_changing_the_math(
    accuracy_run: Path, unclipped: tuple[str, list]
) -> None:
    """``loss_fn`` returns ``(loss, {"accuracy": correct.sum()})``: each step logs the
    correct predictions over the batch of 32 (an exact count), and the weights end as the
    run without the metric's."""
    acc = _accuracy(accuracy_run)
    assert len(acc) == STEPS and all((a * 32).is_integer() and 0 <= a <= 1 for a in acc)
    assert acc[-1] > acc[0]
    assert [m["grad_norm"] for m in _steps(accuracy_run)] == unclipped[1]
    evals = [m for m in read_jsonl(accuracy_run / "metrics.jsonl") if "eval_step" in m]
    assert [e["eval_step"] for e in evals] == [3, 7]
    assert all((e["eval/accuracy"] * 64).is_integer() and e["eval/loss"] > 0 for e in evals)
    assert json.loads((accuracy_run / "summary.json").read_text())["final_hash"] == unclipped[0]


def test_two_workers_log_the_same_metric_bits_as_one(
    accuracy_run: Path, dataset: Path, tmp_path: Path
) -> None:
    run_to_end(_with_accuracy(dataset, 2), tmp_path)
    assert _accuracy(tmp_path) == _accuracy(accuracy_run)


def test_the_metric_reaches_tensorboard_the_snapshot_prometheus_and_the_report(
    accuracy_run: Path,
) -> None:
    from perdure.metrics.prometheus import RunCollector
    from perdure.metrics.tensorboard import train_points
    from perdure.metrics.view import snapshot
    from perdure.report.load import load_run
    from perdure.report.page import render_html

    metrics = _steps(accuracy_run)
    acc = _accuracy(accuracy_run)
    points = [p for p in train_points(metrics) if p.tag == "train/accuracy"]
    assert [(p.step, p.value) for p in points] == list(enumerate(acc))
    snap = snapshot(metrics, [], [])
    assert snap.train == {"accuracy": acc[-1]}
    [family] = [f for f in RunCollector(lambda: snap, lambda: True, "primary", STEPS).collect()
                if f.name == "perdure_train"]  # fmt: skip
    assert [(s.labels["metric"], s.value) for s in family.samples] == [("accuracy", acc[-1])]
    data = load_run(accuracy_run)
    assert data.train == {"accuracy": list(enumerate(acc))}
    assert f"train/accuracy = {acc[-1]:.6g} (step {STEPS - 1})" in render_html(data)


def test_a_loss_fn_whose_metrics_differ_from_the_declared_ones_is_refused_naming_both() -> None:
    loss = torch.tensor(1.0)
    with pytest.raises(ValueError, match=r"returned metrics \['acc'\], Task.metrics declares "
                       r"\['accuracy'\]"):  # fmt: skip
        split_loss((loss, {"acc": 1.0}), ("accuracy",))
    with pytest.raises(ValueError, match="must return \\(loss, \\{name: value\\}\\)"):
        split_loss(loss, ("accuracy",))
    with pytest.raises(ValueError, match="metric 'accuracy' must be a number or one-element"):
        split_loss((loss, {"accuracy": torch.ones(3)}), ("accuracy",))
    assert split_loss((loss, {"accuracy": torch.tensor(2.0)}), ("accuracy",)) == (
        loss,
        {"accuracy": 2.0},
    )


def test_preflight_refuses_a_loss_fn_that_returns_other_metrics_than_declared(
    dataset: Path,
) -> None:
    from perdure.launch.preflight import PreflightError, preflight

    cfg = small_config(dataset, workers=1, steps=STEPS, batch=32,
                       task={"entry": "tests.image_task:make_task",
                             "options": {"accuracy": True, "declare": "acc"}})  # fmt: skip
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    assert [(p.key, p.rule) for p in info.value.problems] == [
        ("task.entry", "task.loss_fn: returned metrics ['accuracy'], Task.metrics declares "
         "['acc']")
    ]  # fmt: skip
