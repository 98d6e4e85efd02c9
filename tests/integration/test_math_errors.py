"""Non-finite math that no data explains stops the run instead of quarantining data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from perdure.runtime.replica.trainer import MathError, Trainer
from tests.runtime_support import small_config


def _step(t: Trainer, step: int) -> None:
    slots = t.config.train.slots
    bufs = [t.layout.new_buffer() for _ in range(slots)]
    assert t.compute_slots(step, range(slots), bufs)
    t.apply(step, sum(bufs[1:], bufs[0].clone()))


def test_a_non_finite_update_from_a_finite_gradient_is_a_math_error(
    small_dataset: Path, tmp_path: Path
) -> None:
    cfg = small_config(small_dataset, workers=1, steps=10, optim={"weight_decay": 1e300})
    t = Trainer(cfg, cache_dir=str(tmp_path))
    try:
        with pytest.raises(MathError, match=r"optim\.weight_decay"):
            for step in range(5):
                _step(t, step)
        assert not all(torch.isfinite(p).all() for p in t.model.parameters())
        assert t.decisions == []  # nothing was quarantined
    finally:
        t.close()


def test_a_sane_config_never_trips_the_check(small_dataset: Path, tmp_path: Path) -> None:
    cfg = small_config(small_dataset, workers=1, steps=10)
    t = Trainer(cfg, cache_dir=str(tmp_path))
    try:
        for step in range(3):
            _step(t, step)
        assert t.next_step == 3
    finally:
        t.close()


def test_a_run_whose_update_goes_non_finite_stops_with_the_reason_and_quarantines_nothing(
    small_dataset: Path, tmp_path: Path
) -> None:
    from perdure import events as ev
    from perdure.launch.local import RunFailed
    from tests.runtime_support import events, run_to_end

    cfg = small_config(small_dataset, workers=2, steps=40, optim={"weight_decay": 1e300})
    with pytest.raises(RunFailed, match=r"non-finite .*optim\.weight_decay"):
        run_to_end(cfg, tmp_path)
    assert len(events(tmp_path, ev.RUN_FAILED)) == 1
    assert events(tmp_path, ev.DECISION) == []
    assert (tmp_path / "summary.json").exists()
    assert "non-finite" in (tmp_path / "report.html").read_text()  # where it failed
