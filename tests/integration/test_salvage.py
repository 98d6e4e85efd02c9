"""Partial-step salvage: a kill costs the dead member's slots, not the whole step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from perdure.runtime.replica.salvage import SlotSalvage
from tests.runtime_support import events, run_to_end, small_config

STEPS = 18


def test_a_kept_slot_is_reused_only_under_the_same_step_and_state() -> None:
    salvage, kept = SlotSalvage(), torch.arange(4.0)
    salvage.put((7, 3), 2, kept)
    into = torch.zeros(4)
    assert not salvage.take((7, 4), 2, into) and not salvage.take((8, 3), 2, into)
    assert not salvage.take((7, 3), 1, into) and torch.equal(into, torch.zeros(4))
    assert salvage.take((7, 3), 2, into) and torch.equal(into, kept)
    assert salvage.pop_reused() == [2] and salvage.pop_reused() == []
    salvage.put((8, 3), 0, into)  # a new key drops the old step's slots
    assert not salvage.take((7, 3), 2, torch.zeros(4))


@pytest.mark.parametrize("reduction", ["chain", "exact"])
def test_survivors_reuse_their_finished_slots_and_the_bits_do_not_change(
    small_dataset: Path, tmp_path: Path, reduction: str
) -> None:
    """The forms that keep a buffer per slot: the chain and the exact step form (the
    carried and streamed forms add each slot to one accumulator, so there is no finished
    slot to reuse: docs/architecture.md, limits)."""
    train = {"reduction": reduction, "reduction_exponents": "step", "reduction_bits": 64}
    ref = run_to_end(
        small_config(small_dataset, workers=1, steps=STEPS, train=train), tmp_path / "ref"
    )
    faults = [{"kind": "kill", "target": "r0-2", "at_step": STEPS // 3}]
    cfg = small_config(small_dataset, workers=3, steps=STEPS, train=train, chaos={"faults": faults})
    s = run_to_end(cfg, tmp_path / "run")
    assert s["final_hash"] == ref["final_hash"] and s["survivor_restarts"] == 0
    salvaged = events(tmp_path / "run", "slots_salvaged")
    assert salvaged, "no survivor reused a finished slot after the kill"
    assert {e["worker"] for e in salvaged} <= {"r0-0", "r0-1"}
    assert all(e["step"] >= STEPS // 3 for e in salvaged)
