"""train.precision = "bf16" and "fp16": autocast forward, fp32 state, bits independent of
placement; under fp16 the loss scale's path (overflows, growths) is the same on any
membership and across a resume, and reaches every metrics sink."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from examples.tiny_lm.task import loss_fn, make_task
from perdure.checkpoint import load_checkpoint
from perdure.events import read_jsonl
from perdure.runtime.replica.slots import SlotEngine
from tests.runtime_support import events, run_to_end, small_config

STEPS = 16
FP16 = {"precision": "fp16", "loss_scale_init": 2.0**22, "loss_scale_growth_interval": 4}
"""An initial scale that overflows this model's first steps (about 2**16 fits), and a
growth every 4 clean steps: overflows and growths within a short run."""


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
    assert not any("loss_scale" in m for m in read_jsonl(tmp_path / "a" / "metrics.jsonl"))


def _scale_events(run_dir: Path) -> list[dict[str, Any]]:
    return [{k: v for k, v in e.items() if k != "t"} for e in events(run_dir, "loss_scale")]


def _scales(run_dir: Path) -> list[tuple[int, float]]:
    """(step, the scale its gradient was computed at), from metrics.jsonl."""
    return [(m["step"], m["loss_scale"]) for m in read_jsonl(run_dir / "metrics.jsonl")]


@pytest.fixture(scope="module")
def fp16_ref(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    run_dir = tmp_path_factory.mktemp("fp16-ref")
    s = run_to_end(small_config(small_dataset, workers=1, steps=STEPS, train=FP16), run_dir)
    return {**s, "run_dir": run_dir}


def test_fp16_runs_on_one_and_two_workers_end_bitwise_equal_with_the_same_scale_events(
    fp16_ref: dict[str, Any], small_dataset: Path, tmp_path: Path
) -> None:
    two = run_to_end(small_config(small_dataset, workers=2, steps=STEPS, train=FP16), tmp_path)
    ref = fp16_ref["run_dir"]
    assert two["replica_hashes_agree"] and two["final_hash"] == fp16_ref["final_hash"]
    log = _scale_events(ref)
    assert _scale_events(tmp_path) == log and _scales(tmp_path) == _scales(ref)
    # step 0 overflows at 2**22 and is computed again at half the scale until it fits
    first = [e for e in log if e["step"] == 0]
    assert first[0]["old"] == FP16["loss_scale_init"] and len(first) > 1
    assert all(e["reason"] == "overflow" and e["new"] == e["old"] / 2 and e["slots"]
               for e in first)  # fmt: skip
    # every step ran at the scale the log says: replayed, the events give the metrics
    scale, at = FP16["loss_scale_init"], {}
    for t in range(STEPS):
        for e in (e for e in log if e["step"] == t and e["reason"] == "overflow"):
            assert e["old"] == scale
            scale = e["new"]
        at[t] = scale
        for e in (e for e in log if e["step"] == t and e["reason"] == "growth"):
            assert e["old"] == scale and e["new"] == 2 * scale
            scale = e["new"]
    assert _scales(ref) == sorted(at.items())
    # a growth after 4 clean steps: the overflowed step counts as the first of them
    changes = [(e["step"], e["reason"]) for e in log]
    growths = [i for i, (_, why) in enumerate(changes) if why == "growth"]
    assert len(growths) >= 2
    for i in growths:
        before, why = changes[i - 1]
        assert changes[i][0] == before + (3 if why == "overflow" else 4)
    for run_dir in (ref, tmp_path):  # an overflow blames no worker and no data
        assert events(run_dir, "suspect_worker") == [] and events(run_dir, "decision") == []


def test_a_resume_from_the_middle_retraces_the_scale_and_the_hash(
    fp16_ref: dict[str, Any], small_dataset: Path, tmp_path: Path
) -> None:
    ref, half = fp16_ref["run_dir"], STEPS // 2
    cfg = small_config(small_dataset, workers=2, steps=STEPS, train=FP16)
    ckpt = ref / "checkpoints" / f"step-{half:09d}"
    s = run_to_end(cfg, tmp_path, resume=str(ckpt))
    assert s["final_hash"] == fp16_ref["final_hash"]
    assert _scales(tmp_path) == _scales(ref)[half:]
    assert _scale_events(tmp_path) == [e for e in _scale_events(ref) if e["step"] >= half]
    end = f"step-{STEPS:09d}"
    mine = load_checkpoint(tmp_path / "checkpoints" / end).optimizer["loss_scale"]
    assert mine == load_checkpoint(ref / "checkpoints" / end).optimizer["loss_scale"]
    # the checkpoint holds the scale the last change before it left (state, not a metric)
    left = [e["new"] for e in _scale_events(ref) if e["step"] < half][-1]
    assert load_checkpoint(ckpt).optimizer["loss_scale"]["scale"] == left


def test_the_loss_scale_reaches_tensorboard_the_snapshot_and_prometheus(
    fp16_ref: dict[str, Any],
) -> None:
    from perdure.metrics.prometheus import RunCollector
    from perdure.metrics.tensorboard import train_points
    from perdure.metrics.view import snapshot

    metrics = list(read_jsonl(fp16_ref["run_dir"] / "metrics.jsonl"))
    scales = _scales(fp16_ref["run_dir"])
    points = [p for p in train_points(metrics) if p.tag == "train/loss_scale"]
    assert [(p.step, p.value) for p in points] == scales
    snap = snapshot(metrics, [], [])
    assert snap.loss_scale == scales[-1][1]
    [family] = [f for f in RunCollector(lambda: snap, lambda: True, "primary", STEPS).collect()
                if f.name == "perdure_loss_scale"]  # fmt: skip
    assert [x.value for x in family.samples] == [scales[-1][1]]


def _fp16_trainer(ds: Path, **train: Any) -> Any:
    from perdure.runtime.replica.trainer import Trainer

    cfg = small_config(ds, workers=1, steps=STEPS, slots=2, batch=4, train={**FP16, **train})
    return Trainer(cfg)


def test_the_scale_is_state_in_a_checkpoint_and_a_state_copy_and_changes_only_by_an_update(
    small_dataset: Path, tmp_path: Path
) -> None:
    """A backed-off scale is the step's until its update commits it (an abandoned attempt
    starts again from the committed one); then a checkpoint and a state copy carry it."""
    from perdure.checkpoint import save_checkpoint

    init = 2.0**12  # it fits: the backed-off step applies a finite gradient
    a, b = (_fp16_trainer(small_dataset, loss_scale_init=init) for _ in range(2))
    try:
        a.begin_step()
        a.back_off(0, [1])
        assert a.engine.scale == init / 2 and a.checkpoint_state({}).optimizer["loss_scale"] == {
            "scale": init, "clean": 0}  # fmt: skip
        a.begin_step()  # the attempt was abandoned: the committed scale again
        assert a.engine.scale == init and a.take_scale_changes() == []
        a.back_off(0, [0, 1])
        bufs = [a.layout.new_buffer() for _ in range(2)]
        assert a.compute_slots(0, range(2), bufs)
        assert a.layout.bad_slots(bufs[0] + bufs[1]) == []
        a.apply(0, bufs[0] + bufs[1])
        assert a.take_scale_changes() == [
            {"step": 0, "old": init, "new": init / 2, "reason": "overflow", "slots": [0, 1]}
        ]
        after = {"scale": init / 2, "clean": 1}
        assert a.step_loss_scale == init / 2 and a.engine.scale == init / 2
        path = save_checkpoint(tmp_path, a.checkpoint_state({}))
        assert load_checkpoint(path).optimizer["loss_scale"] == after
        b.adopt(*a.export())
        assert b.loss_scale == a.loss_scale and b.engine.scale == init / 2
        c = _fp16_trainer(small_dataset, loss_scale_init=init)
        try:
            c.load(path)
            assert c.loss_scale == a.loss_scale and c.engine.scale == init / 2
        finally:
            c.close()
    finally:
        a.close()
        b.close()


def test_an_overflow_at_the_minimum_scale_stops_the_run_naming_the_field(
    small_dataset: Path,
) -> None:
    from perdure.runtime.replica.trainer import MathError

    t = _fp16_trainer(small_dataset, loss_scale_init=4.0, loss_scale_min=4.0)
    try:
        t.begin_step()
        with pytest.raises(MathError, match=r"slots \[3\] overflows float16 at the minimum "
                           r"loss scale \(train\.loss_scale_min = 4\.0\)"):  # fmt: skip
            t.back_off(7, [3])
    finally:
        t.close()
