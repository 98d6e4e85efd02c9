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


def test_a_partial_sum_is_taken_whole_by_a_pass_holding_all_its_slots_and_only_once() -> None:
    salvage, partial = SlotSalvage(), object()
    salvage.put((7, 3), 5, torch.zeros(2))
    salvage.put_sum((7, 3), [2, 0, 1], partial)
    assert salvage.held((7, 3)) == [0, 1, 2, 5] and salvage.held((7, 4)) == []
    assert salvage.take_sum((7, 3), [1, 2, 3]) == ((), None)  # slot 0 is another's now
    assert salvage.take_sum((7, 4), [0, 1, 2]) == ((), None)
    assert salvage.take_sum((7, 3), [0, 1, 2, 3]) == ((0, 1, 2), partial)
    assert salvage.take_sum((7, 3), [0, 1, 2, 3]) == ((), None)  # handed over once
    salvage.put_sum((7, 3), [0], partial)
    salvage.put((8, 3), 0, torch.zeros(2))  # a new key drops it
    assert salvage.take_sum((7, 3), [0]) == ((), None)


@pytest.mark.parametrize("reduction", ["chain", "exact"])
def test_survivors_reuse_their_finished_slots_and_the_bits_do_not_change(
    small_dataset: Path, tmp_path: Path, reduction: str
) -> None:
    """The forms that keep a buffer per slot: the chain and the exact step form. (The
    streamed form keeps a partial sum only while a survivor is between slots, before its
    last slot is on the wire; at this model's few milliseconds a slot the survivors are
    past that when they learn of the kill, so its salvage is tested in one process below.)"""
    train = {"reduction": reduction, "reduction_exponents": "step", "reduction_bits": 64}
    ref = run_to_end(
        small_config(small_dataset, workers=1, steps=STEPS, train=train), tmp_path / "ref"
    )
    # r0-2's reads are slowed from the start (timing only), so the survivors wait for it
    # in each step's reduction with their slots done when the kill lands: at a few
    # milliseconds a slot, a kill landing as they began the step found nothing finished
    # (1 of 7 runs under load, more as steps got faster).
    faults = [
        {"kind": "slow_storage", "target": "r0-2", "at_step": 1, "delay_ms": 30,
         "duration_s": 60.0},
        {"kind": "kill", "target": "r0-2", "at_step": STEPS // 3},
    ]  # fmt: skip
    cfg = small_config(small_dataset, workers=3, steps=STEPS, train=train, chaos={"faults": faults})
    s = run_to_end(cfg, tmp_path / "run")
    assert s["final_hash"] == ref["final_hash"] and s["survivor_restarts"] == 0
    salvaged = events(tmp_path / "run", "slots_salvaged")
    assert salvaged, "no survivor reused a finished slot after the kill"
    assert {e["worker"] for e in salvaged} <= {"r0-0", "r0-1"}
    assert all(e["step"] >= STEPS // 3 for e in salvaged)


def test_an_abandoned_streamed_pass_keeps_its_partial_sum_and_the_redo_computes_the_rest(
    small_dataset: Path,
) -> None:
    """In one process, the default reduction (streamed exponents, 32 bits): step 1's pass
    is abandoned once three slots are done (the epoch's ``should_stop``); the next epoch's
    runner (a new reducer, the same trainer and salvage) starts from their partial sum,
    computes the other five slots and gets the uninterrupted run's sum, bit for bit."""
    from perdure.runtime.comm.group import Abandoned
    from tests.runtime_support import step_runner

    cfg = small_config(small_dataset, workers=1, steps=4, slots=8, batch=16)
    ref = step_runner(cfg, [])
    ref.tr.apply(0, ref.gradient(0, 0.0))
    want = ref.gradient(1, 0.0).clone()

    done: list[int] = []
    salvage, logged = SlotSalvage(), []  # type: ignore[var-annotated]
    a = step_runner(cfg, logged, salvage=salvage, should_stop=lambda t: t == 1 and len(done) >= 3)
    compute = a.tr.engine.compute

    def counted(step: int, slot: int, *args: object, **kwargs: object) -> object:
        out = compute(step, slot, *args, **kwargs)
        done.append(slot)
        return out

    a.tr.engine.compute = counted
    a.tr.apply(0, a.gradient(0, 0.0))
    done.clear()
    with pytest.raises(Abandoned):
        a.gradient(1, 0.0)
    assert done == [0, 1, 2] and salvage.held((1, a.tr.state_version)) == [0, 1, 2]
    b = step_runner(cfg, logged, trainer=a.tr, salvage=salvage)
    done.clear()
    got = b.gradient(1, 0.0)
    assert torch.equal(got, want)
    assert sorted(done) == [3, 4, 5, 6, 7]
    assert [e for e in logged if e["event"] == "slots_salvaged"] == [
        {"event": "slots_salvaged", "worker": "w0", "step": 1, "slots": [0, 1, 2]}
    ]
