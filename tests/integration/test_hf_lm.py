"""A ``transformers`` model (examples/hf_lm: a random-init GPT-2 with dropout) keeps the
invariant like perdure's own: the same bits with 1 and 3 workers, and with a worker
killed mid-run (kill -9, a replacement forked from the zygote that preloaded
``transformers``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.runtime_support import events, run_to_end, small_config

pytest.importorskip("transformers")

STEPS = 32
HF = {
    "entry": "examples.hf_lm.task:make_task",
    "options": {"d_model": 32, "n_layers": 2, "n_heads": 2, "dropout": 0.1, "max_len": 128},
}


def _config(
    dataset: Path, workers: int, faults: list[dict[str, Any]] | None = None, **kw: Any
) -> Any:
    kw.setdefault("task", HF)
    return small_config(
        dataset,
        workers=workers,
        regions=min(workers, 2),
        steps=STEPS,
        chaos={"faults": faults or []},
        **kw,
    )


@pytest.fixture(scope="module")
def one_worker(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_to_end(_config(small_dataset, 1), tmp_path_factory.mktemp("hf1"))


def test_a_transformers_model_with_three_workers_ends_bitwise_equal_to_one(
    one_worker: dict, small_dataset: Path, tmp_path: Path
) -> None:
    s = run_to_end(_config(small_dataset, 3), tmp_path)
    assert s["steps"] == STEPS and s["replica_hashes_agree"]
    assert s["final_hash"] == one_worker["final_hash"] is not None


def test_a_killed_worker_does_not_change_a_transformers_models_final_weights(
    one_worker: dict, small_dataset: Path, tmp_path: Path
) -> None:
    # Early: the survivors' remaining steps must outlast the launcher's replacement delay
    # (a CI run once finished the last 12 steps before the replacement started).
    kill = {"kind": "kill", "target": "r1-0", "at_step": STEPS // 4}
    s = run_to_end(_config(small_dataset, 3, [kill]), tmp_path)
    assert s["final_hash"] == one_worker["final_hash"]
    assert s["survivor_restarts"] == 0 and s["steps_lost"] == 0
    assert [f["kind"] for f in s["faults"]] == ["kill"] and s["faults"][0]["absorbed"]
    assert [e["worker"] for e in events(tmp_path, "replacement_started")] == ["r1-0"]


def test_a_transformers_model_sharded_at_rest_ends_bitwise_equal_to_one(
    one_worker: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """GPT-2 ties its head by sharing the Parameter (two state dict names, one tensor):
    the shard's holders write it under both names, the final hash fetches both, and the
    periodic checkpoint reads back whole."""
    from perdure.checkpoint.reference_reader import Checkpoint

    at_rest = {"shard_degree": 2, "shard_params": True}
    s = run_to_end(_config(small_dataset, 2, train=at_rest), tmp_path)
    assert s["final_hash"] == one_worker["final_hash"] is not None
    ckpt = Checkpoint(tmp_path / "checkpoints" / f"step-{STEPS // 2:09d}")
    head, wte = ckpt.tensor("model/lm_head.weight"), ckpt.tensor("model/transformer.wte.weight")
    assert head.tobytes() == wte.tobytes()


def _built(init: str) -> Any:
    from perdure.runtime.config import TaskConfig
    from perdure.runtime.replica.deferred import materialize
    from perdure.runtime.replica.task import build_task

    task = build_task(TaskConfig(init=init, **HF), seed=7)
    if init == "per_module":
        materialize(task.model, seed=7, init=task.init)
    return task.model


def test_a_transformers_model_initialised_per_module_keeps_the_librarys_distributions() -> None:
    """Module by module (``hf_lm.per_module_init``), every parameter is drawn as the
    library's eager ``post_init`` draws it: the same constants (LayerNorm ones, zero
    biases) to the bit, the same spread elsewhere (the residual projections' scaled
    std included, which the library sets from their parents), the head still tied."""
    eager, per_module = _built("eager"), _built("per_module")
    assert per_module.lm_head.weight is per_module.transformer.wte.weight
    a = {n: p.detach() for n, p in eager.named_parameters()}
    b = {n: p.detach() for n, p in per_module.named_parameters()}
    assert a.keys() == b.keys()
    for name, want in a.items():
        got = b[name]
        assert got.shape == want.shape and got.dtype == want.dtype, name
        if bool((want == want.flatten()[0]).all()):
            assert torch.equal(got, want), name
        else:
            assert abs(float(got.std() / want.std()) - 1) < 0.15, name
            assert abs(float(got.mean())) < 0.01, name
            assert not torch.equal(got, want), name  # other draws: (seed, module name)
    again = dict(_built("per_module").named_parameters())
    assert all(torch.equal(again[n], p) for n, p in b.items())


def test_a_transformers_model_initialised_per_module_at_rest_ends_bitwise_equal_to_one(
    small_dataset: Path, tmp_path: Path
) -> None:
    """Two ranks in one replica group, each making only its own shard of GPT-2 from the
    seed: the one-worker per-module run's bits, and no rank held the whole model."""
    task = {**HF, "init": "per_module"}
    one = run_to_end(_config(small_dataset, 1, task=task), tmp_path / "one")
    at_rest = {"shard_degree": 2, "shard_params": True}
    s = run_to_end(_config(small_dataset, 2, task=task, train=at_rest), tmp_path / "two")
    assert s["final_hash"] == one["final_hash"] is not None and s["replica_hashes_agree"]
    rest = events(tmp_path / "two", "params_at_rest")
    whole = sum(p.numel() * 4 for p in _built("per_module").parameters())
    assert rest and all(0 < e["init_peak_bytes"] < 0.75 * whole for e in rest)
