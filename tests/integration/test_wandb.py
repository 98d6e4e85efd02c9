"""The optional W&B sink (``metrics.wandb``): offline, no account, every step's loss and
every evaluation in the run files W&B writes."""

from __future__ import annotations

from pathlib import Path

import pytest

from perdure.events import read_jsonl
from perdure.metrics.tensorboard import Point
from perdure.metrics.wandb_sink import by_step, run_id
from tests.integration.test_eval import held_out  # noqa: F401 (the held-out data set fixture)
from tests.runtime_support import run_to_end, small_config
from tests.wandb_files import history

pytest.importorskip("wandb")
STEPS = 20


def test_rows_are_one_per_step_in_step_order_and_the_id_follows_the_run_dir(
    tmp_path: Path,
) -> None:
    pts = [Point("eval/loss", 9, 2.0, 9, 1.0), Point("train/loss", 9, 3.0, 9, 0.5),
           Point("train/loss", 3, 4.0, 3, 0.1)]  # fmt: skip
    assert by_step(pts) == [{"step": 3, "train/loss": 4.0},
                            {"step": 9, "eval/loss": 2.0, "train/loss": 3.0}]  # fmt: skip
    assert run_id(tmp_path) == run_id(tmp_path / ".") != run_id(tmp_path / "other")
    assert len(run_id(tmp_path)) == 8


def test_an_offline_wandb_run_holds_every_steps_loss_and_the_evaluations(
    small_dataset: Path,
    held_out: Path,  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WANDB_API_KEY", "")  # no account is needed, nor used
    cfg = small_config(
        small_dataset,
        workers=2,
        steps=STEPS,
        task={"entry": "tests.eval_task:with_eval", "options": {}},
        eval={"every_steps": 10, "dataset": str(held_out), "samples": 32, "batch_size": 16},
        metrics={"wandb": True},
    )
    run_to_end(cfg, tmp_path)
    [path] = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert path.name == f"run-{run_id(tmp_path)}.wandb"
    rows = history(path)
    metrics = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if "step" in m]
    loss = {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}
    assert loss == {m["step"]: m["loss"] for m in metrics}  # every step, exactly
    assert sorted(loss) == list(range(STEPS))
    evals = [m for m in read_jsonl(tmp_path / "metrics.jsonl") if "eval_step" in m]
    got = {r["step"]: r["eval/accuracy"] for r in rows if "eval/accuracy" in r}
    assert got == {e["eval_step"]: e["eval/accuracy"] for e in evals} and sorted(got) == [9, 19]
