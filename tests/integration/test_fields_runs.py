"""Runs on imported, multi-field data: ``labels`` and ``loss_mask`` reach the task's
``loss_fn`` as tensors, and the final weights do not depend on the worker count; the
launcher's preflight refuses a dataset the task's declared fields do not fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from perdure.data import Dataset, SlotLoader
from perdure.data.importer import import_arrays
from perdure.events import read_jsonl
from perdure.launch.preflight import PreflightError, preflight
from perdure.run_config import with_overrides
from perdure.runtime.replica.slots import to_tensors
from tests.masked_task import loss_fn, make_task
from tests.runtime_support import STDLIB, run_to_end, small_config

SEQ = 64
VOCAB = 300
"""Above 256, so the tokens are stored as uint16."""
STEPS = 16


@pytest.fixture(scope="module")
def fields_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The stdlib's json package as a uint16 token stream, labels = tokens, and a loss
    mask that hides every fourth position."""
    root = tmp_path_factory.mktemp("fields")
    text = b"".join(f.read_bytes() for f in sorted((STDLIB / "json").glob("*.py")))
    tokens = np.frombuffer(text, dtype=np.uint8).astype("<u2")
    mask = (np.arange(tokens.size) % 4 != 3).astype(np.uint8)
    tokens.tofile(root / "train.bin")
    np.save(root / "labels.npy", tokens.astype(np.int32))
    mask.tofile(root / "mask.bin")
    import_arrays(
        {"tokens": [str(root / "train.bin")], "labels": [str(root / "labels.npy")],
         "loss_mask": [str(root / "mask.bin")]},
        str(root / "ds"), seq_len=SEQ, dtype="uint16", dtypes={"loss_mask": "uint8"},
        vocab_size=VOCAB, part_mb=0.05,
    )  # fmt: skip
    return root / "ds"


def _config(ds: Path, workers: int, **options: Any) -> Any:
    task = {"entry": "tests.masked_task:make_task",
            "options": {"vocab": VOCAB, "d_model": 32, "max_len": SEQ, **options}}  # fmt: skip
    return small_config(ds, workers=workers, steps=STEPS, task=task)


def test_masked_positions_do_not_enter_the_loss(fields_dataset: Path) -> None:
    torch.manual_seed(0)
    task = make_task(vocab=VOCAB, max_len=SEQ)
    task.model.eval()
    with Dataset.open(str(fields_dataset)) as ds, SlotLoader(ds, seed=0, global_batch=4,
                                                             slots=1) as ld:  # fmt: skip
        batch = to_tensors(ld.batch(0, 0))
    assert batch["tokens"].dtype == torch.int64 and ds.manifest.dtype == "uint16"
    changed = dict(batch, labels=batch["labels"].clone())
    hidden = batch["loss_mask"] == 0
    changed["labels"][hidden] = (changed["labels"][hidden] + 1) % VOCAB
    with torch.no_grad():
        assert torch.equal(loss_fn(task.model, batch), loss_fn(task.model, changed))
        changed["labels"][~hidden] = (changed["labels"][~hidden] + 1) % VOCAB
        assert not torch.equal(loss_fn(task.model, batch), loss_fn(task.model, changed))


@pytest.fixture(scope="module")
def reference(fields_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-worker run the two-worker run must match bit for bit."""
    run_dir = tmp_path_factory.mktemp("fields-ref")
    return {**run_to_end(_config(fields_dataset, 1), run_dir), "run_dir": run_dir}


def test_a_one_worker_fields_run_commits_every_step_and_the_loss_falls(reference: dict) -> None:
    assert reference["steps"] == STEPS and reference["final_hash"].startswith("sha256:")
    losses = [m["loss"] for m in read_jsonl(reference["run_dir"] / "metrics.jsonl")]
    assert len(losses) == STEPS
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 0.3, losses


def test_two_workers_end_bitwise_equal_to_one_on_a_fields_dataset(
    reference: dict, fields_dataset: Path, tmp_path: Path
) -> None:
    two = run_to_end(_config(fields_dataset, 2), tmp_path)
    assert two["steps"] == STEPS and two["final_hash"] == reference["final_hash"]


def _problems(cfg: Any) -> list[tuple[str, str, object]]:
    with pytest.raises(PreflightError) as info:
        preflight(cfg)
    return [(p.key, p.rule, p.value) for p in info.value.problems]


def test_preflight_refuses_a_vocabulary_too_big_for_the_model(fields_dataset: Path) -> None:
    [(key, rule, _)] = _problems(_config(fields_dataset, 1, vocab=256))
    assert key == "task.options" and "vocab_size 256" in rule and "dataset's 300" in rule


def test_preflight_refuses_a_field_of_another_shape_or_dtype_naming_both(
    fields_dataset: Path,
) -> None:
    [(key, rule, value)] = _problems(_config(fields_dataset, 1, mask_len=SEQ))
    assert key == "data.dataset" and value == str(fields_dataset)
    assert "field 'loss_mask' has shape [65] in the dataset, the task needs [64]" in rule
    [(key, rule, _)] = _problems(_config(fields_dataset, 1, mask_dtype="float"))
    assert "field 'loss_mask' has dtype uint8 in the dataset, the task needs float" in rule


def test_preflight_refuses_a_dataset_without_a_field_the_task_needs(
    small_dataset: Path,
) -> None:
    cfg = small_config(small_dataset, task={"entry": "tests.masked_task:make_task",
                                            "options": {"max_len": 64}})  # fmt: skip
    problems = _problems(cfg)
    rules = [rule for key, rule, _ in problems if key == "data.dataset"]
    assert any("the task needs field 'labels' (Task.fields); the dataset has ['tokens']" in r
               for r in rules), problems  # fmt: skip
    assert any("needs field 'loss_mask'" in r for r in rules)


def test_a_poisoned_part_of_a_fields_dataset_is_rerun_sample_by_sample_and_quarantined(
    fields_dataset: Path, tmp_path: Path
) -> None:
    """The per-sample rerun slices every field (trainer._row): were one lost, loss_fn
    would raise in the rerun and the run would fail instead of quarantining."""
    poison = {"kind": "poison_part", "target": "1", "at_step": 4}
    cfg = with_overrides(_config(fields_dataset, 2), chaos={"faults": [poison]})
    s = run_to_end(cfg, tmp_path)
    assert s["steps"] == STEPS and s["survivor_restarts"] == 0
    [d] = [d for d in s["decisions"] if d["kind"] == "quarantine"]
    assert d["parts"] == [1] and "reproduced on rerun" in d["reason"]
