"""train.precision = "bf16": autocast forward, fp32 state, bits independent of placement."""

from __future__ import annotations

from pathlib import Path

import torch

from examples.tiny_lm.task import loss_fn, make_task
from perdure.runtime.replica.slots import SlotEngine
from tests.runtime_support import run_to_end, small_config

STEPS = 16


def _grad(precision: str) -> torch.Tensor:
    torch.manual_seed(0)
    task = make_task(d_model=32, n_layers=1, n_heads=2, max_len=64)
    engine = SlotEngine(task.model, loss_fn, seed=3, slots=2, precision=precision)
    g = torch.Generator().manual_seed(1)
    batch = {"tokens": torch.randint(0, 256, (2, 17), generator=g), "weight": torch.ones(2)}
    out = engine.new_buffer()
    engine.compute(0, 1, batch, out)
    assert all(p.dtype == torch.float32 for p in task.model.parameters())
    return out


def test_a_bf16_slot_gradient_is_fp32_reproducible_and_not_the_fp32_one() -> None:
    a, b, full = _grad("bf16"), _grad("bf16"), _grad("fp32")
    assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, full)
    assert torch.allclose(a, full, rtol=0.1, atol=1e-2)  # the same gradient, at bf16's grain


def test_bf16_runs_end_bitwise_equal_for_one_and_two_workers(
    small_dataset: Path, tmp_path: Path
) -> None:
    bf16 = {"precision": "bf16"}
    one = run_to_end(
        small_config(small_dataset, workers=1, steps=STEPS, train=bf16), tmp_path / "a"
    )
    two = run_to_end(
        small_config(small_dataset, workers=2, steps=STEPS, train=bf16), tmp_path / "b"
    )
    fp32 = run_to_end(small_config(small_dataset, workers=1, steps=STEPS), tmp_path / "c")
    assert two["replica_hashes_agree"] and one["final_hash"] == two["final_hash"]
    assert fp32["final_hash"] != one["final_hash"]
