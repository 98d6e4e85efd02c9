"""End-to-end runs with real processes: a spare's state copy overlaps the survivors' first
step (``runtime/member/copy_overlap.py``) and the final parameters are still the uninterrupted
run's, bit for bit."""

from __future__ import annotations

from pathlib import Path

from perdure.runtime.plan import Plan
from tests.runtime_support import events, run_to_end, small_config

STEPS = 60
BUFFER_TASK = {"entry": "tests.buffer_task:make_task", "options": {"d": 16}}


def test_a_spare_copies_behind_the_survivors_step_and_the_weights_do_not_change(
    small_dataset: Path, tmp_path: Path
) -> None:
    """3 members and a warm spare; r0-1 is SIGKILLed at T/3. The spare is promoted into
    its rank and copies the holders' committed state on the copy group while the
    survivors compute the epoch's first step with every slot (the spare has none); it
    takes part in that step's reduction and applies its update. The final parameters
    equal the one-worker run's.

    A survivor whose reduction failed on the killed peer's reset after the other had
    committed the step is one step behind: it is a receiver of the same epoch too (seen
    under load, about one kill in ten), and then the one holder serves both. The checks
    hold for whichever members the epoch made receivers."""
    kill = STEPS // 3
    faults = [{"kind": "kill", "target": "r0-1", "at_step": kill}]
    cfg = small_config(
        small_dataset, workers=3, steps=STEPS, cluster={"spares": 1}, chaos={"faults": faults}
    )
    ref = run_to_end(small_config(small_dataset, workers=1, steps=STEPS), tmp_path / "ref")
    run = tmp_path / "run"
    s = run_to_end(cfg, run)
    assert s["final_hash"] == ref["final_hash"]
    assert s["survivor_restarts"] == 0
    assert [e["worker"] for e in events(run, "spare_promoted")] == ["spare-0"]
    started = next(e for e in events(run, "epoch_started") if "spare-0" in e["receivers"])
    assert started["start_step"] >= kill
    receivers = set(started["receivers"])
    assert receivers <= {"spare-0", "r0-0", "r0-2"} and len(receivers) <= 2
    first = Plan.from_dict(started["first"])
    assert all(len(first.slots_of(first.members.index(r))) == 0 for r in receivers)
    assert sum(len(first.slots_of(r)) for r in range(3)) == 8
    got = {e["worker"]: e for e in events(run, "state_received") if e["epoch"] == started["epoch"]}
    assert set(got) == receivers
    for e in got.values():
        assert (e["mode"], e["overlapped_step"], e["next_step"]) == (
            "overlapped",
            started["start_step"],
            started["start_step"],
        )
    sent = [e for e in events(run, "state_sent") if e["epoch"] == started["epoch"]]
    holders = sorted(m for m in started["plan"]["members"] if m not in receivers)
    assert holders and sorted(e["worker"] for e in sent) == holders
    assert {(e["mode"], e["overlapped_step"], e["next_step"]) for e in sent} == {
        ("overlapped", started["start_step"], started["start_step"])
    }
    assert sum(e["bytes"] for e in sent) == sum(e["bytes"] for e in got.values())
    assert all(sorted(e["holders"]) == holders for e in got.values())


def test_a_model_whose_forward_moves_buffers_copies_its_committed_buffers_while_survivors_step(
    small_dataset: Path, tmp_path: Path
) -> None:
    """BatchNorm and a counter move their buffers in every slot's forward (and are put back
    after it): the holders serve clones of the committed buffers while they compute, so
    the spare's replica and the final parameters are still the one-worker run's. (Whether
    a range is read mid-forward here is up to timing; ``test_copy_overlap`` checks the
    clones against a forward directly.)"""
    steps = 30
    # at 3/5 of the run: the spare is promoted only once prepared (test_shard_runs)
    faults = [{"kind": "kill", "target": "r0-1", "at_step": steps * 3 // 5}]
    cfg = small_config(
        small_dataset,
        workers=3,
        steps=steps,
        task=BUFFER_TASK,
        cluster={"spares": 1},
        chaos={"faults": faults},
    )
    one = small_config(small_dataset, workers=1, steps=steps, task=BUFFER_TASK)
    ref = run_to_end(one, tmp_path / "ref")
    s = run_to_end(cfg, tmp_path / "run")
    assert s["final_hash"] == ref["final_hash"]
    [got] = [e for e in events(tmp_path / "run", "state_received") if e["worker"] == "spare-0"]
    assert got["mode"] == "overlapped" and got["overlapped_step"] == got["next_step"]
