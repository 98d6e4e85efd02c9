"""A checkpoint's snapshot copies the state on a thread while the next step computes
(``checkpoint.snapshot_overlap``); the step waits for it (``StepEnd.before_update``)
before anything writes that state. For a plain model that is the update; where computing
the slots writes it too (``Trainer.computes_in_place``), before the slots: DiLoCo's inner
steps move the parameters in place and BatchNorm's forward moves its buffers (each put
back after). A clean-clone CI saw a DiLoCo checkpoint hold the parameters one inner step
on, and its resume end with another hash. In one process: a step runner of one member."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from perdure.runtime.step import StepEnd, train_step
from tests.runtime_support import small_config, step_runner

BN_TASK = {"entry": "tests.buffer_task:make_task", "options": {"d": 16}}
CASES = {
    "plain": ({}, False),
    "batchnorm": ({"task": BN_TASK}, True),
    "diloco": ({"outer": {"replicas": 4, "inner_steps": 2}}, True),
    "diloco-delayed": (
        {
            "outer": {"replicas": 4, "inner_steps": 2, "delay": 1},
            "train": {"reduction_exponents": "step"},
        },
        True,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_step_waits_for_the_snapshot_before_anything_writes_the_state(
    small_dataset: Path, case: str
) -> None:
    sections, in_place = CASES[case]
    cfg = small_config(small_dataset, workers=1, steps=4, slots=4, batch=16, **sections)
    run = step_runner(cfg, [])
    tr = run.tr
    assert tr.computes_in_place is in_place
    seen: list[str] = []  # what happened, in order: "compute", "update", "wait"
    compute, update = tr.engine.compute, tr.recipe.step

    def counted_compute(*args: Any, **kwargs: Any) -> Any:
        seen.append("compute")
        return compute(*args, **kwargs)

    def counted_update(*args: Any, **kwargs: Any) -> Any:
        seen.append("update")
        return update(*args, **kwargs)

    tr.engine.compute, tr.recipe.step = counted_compute, counted_update  # type: ignore[method-assign]
    end = StepEnd(before_update=lambda: seen.append("wait"), after_update=lambda *a: None)
    for t in range(2):
        seen.clear()
        train_step(run, t, end)
        first_wait = seen.index("wait")
        assert "update" in seen[first_wait:] and "update" not in seen[:first_wait], seen
        if in_place:  # not one slot computed before the snapshot is done
            assert first_wait == 0, seen
        else:  # the snapshot overlaps the slots' forwards and backwards (step 0 twice:
            # the streamed exponents' measuring pass)
            assert seen[:first_wait] == ["compute"] * (8 if t == 0 else 4), seen
