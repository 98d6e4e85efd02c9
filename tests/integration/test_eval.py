"""Evaluation during a run (``runtime/member/evaluate.py``): the task's eval_fn over a held-out
data set every N steps, in every sink, never changing the training's bits."""

from __future__ import annotations

import random
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from perdure.config import ConfigError
from perdure.data import Dataset, build_dataset
from perdure.events import read_jsonl
from perdure.run_config import config_from_dict, config_hash
from perdure.runtime.config import EvalConfig, TaskConfig
from perdure.runtime.member.evaluate import EvalError, Evaluator, due, eval_ids
from perdure.runtime.replica.task import build_task
from tests.runtime_support import events, run_to_end, small_config

STEPS = 20
EVERY = 10


@pytest.fixture(scope="module")
def held_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another part of the stdlib than the training data: never trained on."""
    out = tmp_path_factory.mktemp("eval") / "held-out"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    build_dataset([str(stdlib / "logging")], str(out), seq_len=64, part_mb=0.05, include="*.py")
    return out


def _cfg(train: Path, held_out: Path | None, entry: str = "with_eval", **eval_: Any) -> Any:
    task = {"entry": f"tests.eval_task:{entry}", "options": {}}
    sections: dict[str, Any] = {"task": task}
    if held_out is not None:
        sections["eval"] = {"every_steps": EVERY, "dataset": str(held_out), "samples": 48,
                            "batch_size": 16, **eval_}  # fmt: skip
    return small_config(train, workers=2, steps=STEPS, **sections)


@pytest.fixture(scope="module")
def plain(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The run without evaluation: the reference hash."""
    return run_to_end(_cfg(small_dataset, None), tmp_path_factory.mktemp("eval-off"))


def test_an_eval_every_10_steps_reaches_every_sink_and_leaves_the_hash_alone(
    small_dataset: Path, held_out: Path, plain: dict[str, Any], tmp_path: Path
) -> None:
    with_eval = run_to_end(_cfg(small_dataset, held_out), tmp_path / "on")
    assert with_eval["final_hash"] == plain["final_hash"]

    rows = read_jsonl(tmp_path / "on" / "metrics.jsonl")
    evals = [r for r in rows if "eval_step" in r]
    assert [e["eval_step"] for e in evals] == [9, 19]
    for e in evals:
        assert set(e) >= {"eval/loss", "eval/accuracy", "eval/jitter", "eval_samples"}
        assert e["eval_samples"] == 48 and 0 <= e["eval/accuracy"] <= 1
    assert evals[1]["eval/loss"] < evals[0]["eval/loss"]  # it learns, and eval sees it
    assert [r["step"] for r in rows if "step" in r] == list(range(STEPS))

    # TensorBoard: eval/<name> at the steps evaluated
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "on" / "tb"))
    acc.Reload()
    points = [(s.step, s.value) for s in acc.Scalars("eval/loss")]
    assert points == [(9, pytest.approx(evals[0]["eval/loss"])),
                      (19, pytest.approx(evals[1]["eval/loss"]))]  # fmt: skip

    # the report
    from perdure.report.page import write_report

    html = write_report(tmp_path / "on").read_text()
    assert "<h2>Evaluation</h2>" in html and "eval/accuracy on the held-out data set" in html
    assert f"eval/loss = {evals[1]['eval/loss']:.6g} (after step 19)" in html

    # Prometheus, from the view of the same logs
    from perdure.metrics.prometheus import RunCollector
    from perdure.metrics.view import is_eval, snapshot

    steps = [r for r in rows if "step" in r]
    snap = snapshot(steps, [], [], [r for r in rows if is_eval(r)])
    assert snap.eval_step == 19 and snap.step == STEPS - 1
    assert snap.evals["loss"] == evals[1]["eval/loss"]
    families = {f.name: f for f in RunCollector(lambda: snap, lambda: True, "primary", STEPS,
                                                run="r").collect()}  # fmt: skip
    got = {s.labels["metric"]: s.value for s in families["perdure_eval"].samples}
    assert got == {k[5:]: v for k, v in evals[1].items() if k.startswith("eval/")}


def test_eval_samples_are_evenly_spaced_fixed_ids_and_due_follows_every_steps() -> None:
    assert eval_ids(10, 5).tolist() == [0, 2, 4, 6, 8]
    assert eval_ids(7, 0).tolist() == list(range(7)) == eval_ids(7, 100).tolist()
    cfg = EvalConfig(every_steps=10, dataset="d")
    assert [n for n in range(1, 31) if due(cfg, n)] == [10, 20, 30]
    assert not any(due(EvalConfig(), n) for n in range(1, 31))


def test_eval_settings_are_validated_and_not_part_of_the_config_hash(
    small_dataset: Path, held_out: Path
) -> None:
    with pytest.raises(ConfigError, match=r"eval.dataset"):
        config_from_dict({"eval": {"every_steps": 5}})
    with pytest.raises(ConfigError, match=r"eval.batch_size"):
        config_from_dict({"eval": {"batch_size": 0}})
    with pytest.raises(ConfigError, match=r"eval.every_steps.*shard_params"):
        config_from_dict({"eval": {"every_steps": 5, "dataset": "d"},
                          "train": {"reduction": "exact", "shard_degree": 2,
                                    "shard_params": True}})  # fmt: skip
    on, off = _cfg(small_dataset, held_out), _cfg(small_dataset, None)
    assert config_hash(on) == config_hash(off)


def _evaluator(dataset: Path, entry: str = "with_eval", **cfg: Any) -> Evaluator:
    task = build_task(TaskConfig(entry=f"tests.eval_task:{entry}"), 7)
    settings = {"every_steps": 1, "dataset": str(dataset), "samples": 40, "batch_size": 16}
    return Evaluator(task, EvalConfig(**{**settings, **cfg}), Dataset.open(str(dataset)), seed=7)


def test_an_evaluation_is_deterministic_and_leaves_generators_grads_and_modes_alone(
    held_out: Path,
) -> None:
    ev = _evaluator(held_out)
    model = ev.model
    model.train()
    torch.manual_seed(3)
    np.random.seed(3)
    random.seed(3)
    before = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    first = ev.run(5)
    assert (torch.get_rng_state() == before[0]).all()
    assert (np.random.get_state()[1] == before[1]).all() and random.getstate() == before[2]
    assert all(m.training for m in model.modules())  # train mode restored
    assert all(p.grad is None for p in model.parameters())
    assert first == ev.run(5) and set(first) == {"eval/loss", "eval/accuracy", "eval/jitter"}
    # batches of 16, 16 and 8: the mean over the 40 samples, not over the batches
    whole = _evaluator(held_out, batch_size=40).run(5)
    assert whole["eval/loss"] == pytest.approx(first["eval/loss"], rel=1e-6)
    assert whole["eval/accuracy"] == pytest.approx(first["eval/accuracy"], rel=1e-6)
    ev.close()


def test_without_eval_fn_the_loss_fn_gives_eval_loss_per_sample(held_out: Path) -> None:
    own = _evaluator(held_out).run(0)
    loss_only = Evaluator(
        build_task(TaskConfig(entry="tests.eval_task:with_eval", options={"own_eval": False}), 7),
        EvalConfig(every_steps=1, dataset=str(held_out), samples=40, batch_size=16),
        Dataset.open(str(held_out)),
        seed=7,
    ).run(0)
    assert set(loss_only) == {"eval/loss"}
    assert loss_only["eval/loss"] == pytest.approx(own["eval/loss"], rel=1e-5)


def test_an_eval_fn_returning_no_number_is_refused_by_name(held_out: Path) -> None:
    with pytest.raises(EvalError, match=r"task\.eval_fn: 'loss' must be a number"):
        _evaluator(held_out, "broken_eval").run(0)


def test_preflight_refuses_a_missing_held_out_set_and_a_broken_eval_fn_by_name(
    small_dataset: Path, held_out: Path, tmp_path: Path
) -> None:
    from perdure.launch.preflight import PreflightError, preflight

    with pytest.raises(PreflightError, match=r"eval\.dataset.*no dataset there"):
        preflight(_cfg(small_dataset, tmp_path / "nowhere"))
    with pytest.raises(PreflightError, match=r"task\.eval_fn raised EvalError.*'loss'"):
        preflight(_cfg(small_dataset, held_out, "broken_eval"))
    preflight(_cfg(small_dataset, held_out))  # the good one passes


def test_a_killed_rank_0_changes_neither_the_hash_nor_the_evaluations_numbers(
    small_dataset: Path, held_out: Path, plain: dict[str, Any], tmp_path: Path
) -> None:
    calm = _cfg(small_dataset, held_out)
    run_to_end(calm, tmp_path / "calm")
    faults = [{"kind": "kill", "target": "r0-0", "at_step": 12}]  # rank 0, between evaluations
    cfg = small_config(small_dataset, workers=3, regions=2, steps=STEPS, cluster={"spares": 1},
                       chaos={"faults": faults}, task=calm.task.__dict__ | {},
                       eval=calm.eval.__dict__ | {})  # fmt: skip
    s = run_to_end(cfg, tmp_path / "killed")
    assert [e["worker"] for e in events(tmp_path / "killed", "leave")] == ["r0-0"]
    assert s["final_hash"] == plain["final_hash"]

    def evals(run: str) -> list[dict[str, Any]]:
        rows = read_jsonl(tmp_path / run / "metrics.jsonl")
        return [{k: v for k, v in r.items() if k.startswith("eval")  and k != "eval_s"}
                for r in rows if "eval_step" in r]  # fmt: skip

    assert evals("killed") == evals("calm") and len(evals("calm")) == 2  # bitwise the same
