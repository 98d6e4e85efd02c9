"""End-to-end runs with real processes: a spare's state copy overlaps the survivors' first
step (``runtime/member/copy_overlap.py``) and the final parameters are still the uninterrupted
run's, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize("pace", ["whole", "fixed"], ids=["overlapped", "paced"])
def test_a_model_whose_forward_moves_buffers_copies_its_committed_buffers_while_survivors_step(
    small_dataset: Path, tmp_path: Path, pace: str
) -> None:
    """BatchNorm and a counter move their buffers in every slot's forward (and are put back
    after it): the holders serve clones of the committed buffers while they compute, so
    the spare's replica and the final parameters are still the one-worker run's. Paced,
    the buffers travel in the first part and the spare applies each step's buffer moves
    from the reduced sum to them, as to every parameter it holds. (Whether
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
        cluster={"spares": 1, "copy_pace": pace, "copy_step_mb": 0.002},
        chaos={"faults": faults},
    )
    one = small_config(small_dataset, workers=1, steps=steps, task=BUFFER_TASK)
    ref = run_to_end(one, tmp_path / "ref")
    s = run_to_end(cfg, tmp_path / "run")
    assert s["final_hash"] == ref["final_hash"]
    got = [e for e in events(tmp_path / "run", "state_received") if e["worker"] == "spare-0"]
    assert got[0]["overlapped_step"] == got[0]["next_step"]
    if pace == "fixed":  # the buffers in the first part, the receiver moving them since
        assert {e["mode"] for e in got} == {"paced"} and len(got) > 1
        assert [e["complete"] for e in got] == [False] * (len(got) - 1) + [True]
    else:
        assert [e["mode"] for e in got] == ["overlapped"]


def _paced_run(
    small_dataset: Path,
    run: Path,
    *,
    every: int,
    steps: int = STEPS,
    faults: list[dict] | None = None,
    pace: str = "fixed",
    step_mb: float = 0.002,
) -> tuple[dict, list[dict], list[dict], dict]:
    """3 members and a warm spare, r0-1 killed at T/3 (or ``faults``), the spare's copy
    paced over steps (``copy_pace = "fixed"``, 2 kB a part: a tiny_lm's parameters a few at a
    time); the summary, the spare's parts and the holders' of its first paced epoch, and
    that epoch's start."""
    faults = faults or [{"kind": "kill", "target": "r0-1", "at_step": steps // 3}]
    cfg = small_config(
        small_dataset,
        workers=3,
        steps=steps,
        cluster={"spares": 1, "copy_pace": pace, "copy_step_mb": step_mb},
        chaos={"faults": faults},
        checkpoint={"every_steps": every, "keep_last": 100},
    )
    s = run_to_end(cfg, run)
    started = next(e for e in events(run, "epoch_started") if "spare-0" in e["receivers"])
    got = [
        e
        for e in events(run, "state_received")
        if e["epoch"] == started["epoch"] and e["worker"] == "spare-0"
    ]
    sent = [e for e in events(run, "state_sent") if e["epoch"] == started["epoch"]]
    return s, got, sent, started


def test_a_copy_paced_over_steps_leaves_the_weights_of_the_uninterrupted_run(
    small_dataset: Path, tmp_path: Path
) -> None:
    """Paced, the spare receives the state a few parameters a step, part j in step s + j,
    while it takes part in every step's reduction with no slot and applies each update to
    what it holds: the parts it received earlier stay at the holders' version, the later
    ones are written over. Every holder serves every part behind its step, and the final
    parameters are the one-worker run's, bit for bit (the fingerprints every 10 steps
    compare the holders alone while the spare is partial)."""
    ref = run_to_end(small_config(small_dataset, workers=1, steps=STEPS), tmp_path / "ref")
    s, got, sent, started = _paced_run(small_dataset, tmp_path / "run", every=STEPS)
    assert s["final_hash"] == ref["final_hash"]
    assert s["survivor_restarts"] == 0
    parts = len(got)
    assert parts > 2
    start = started["start_step"]
    assert [(e["part"], e["complete"], e["next_step"]) for e in got] == [
        (j, j == parts - 1, start + j) for j in range(parts)
    ]
    assert {e["mode"] for e in got} == {"paced"}
    holders = sorted(m for m in started["plan"]["members"] if m not in started["receivers"])
    for j in range(parts):
        part = [e for e in sent if e["part"] == j]
        assert sorted(e["worker"] for e in part) == holders
        assert {(e["next_step"], e["mode"]) for e in part} == {(start + j, "paced")}
        assert sum(e["bytes"] for e in part) == got[j]["bytes"]


def test_an_automatic_pace_sizes_the_next_part_from_the_first_ones_rate(
    small_dataset: Path, tmp_path: Path
) -> None:
    """``copy_pace = "auto"`` with a first part of 100 bytes (the buffers and the first
    parameter): the source measured that part's rate and its compute of a step, and
    budgets the next part from them, far more than 100 bytes (here tens of kB: parts
    this small are mostly the copy's fixed cost, so their measured rate is low). The
    final bits are the one-worker run's."""
    ref = run_to_end(small_config(small_dataset, workers=1, steps=STEPS), tmp_path / "ref")
    s, got, _, _ = _paced_run(
        small_dataset, tmp_path / "run", every=STEPS, pace="auto", step_mb=0.0001
    )
    assert s["final_hash"] == ref["final_hash"]
    assert len(got) >= 2 and got[-1]["complete"]
    assert max(e["bytes"] for e in got[1:]) > 100 * got[0]["bytes"] > 0
    # fixed at 100 bytes, every parameter would travel alone: a part per group
    from examples.tiny_lm.task import make_task

    model = make_task(d_model=32, n_layers=1, n_heads=2, max_len=128).model
    assert len(got) < len(list(model.parameters())) + 1
    assert {e["mode"] for e in got} == {"paced"}


def test_a_save_due_while_a_copy_is_paced_is_written_by_the_holders_with_the_runs_bits(
    small_dataset: Path, tmp_path: Path
) -> None:
    """A checkpoint due every 2 steps falls in the paced copy's window again and again:
    the spare, partial, writes no tensor of it, the holders write its share too, and the
    copy goes on paced (no flush). Every checkpoint of the faulty run holds the same model
    and optimizer bits as the one-worker run's of the same step (the spare's share, had it
    written it, holds zeros and seed values), and the final parameters too."""
    steps = 30
    one = small_config(
        small_dataset, workers=1, steps=steps, checkpoint={"every_steps": 2, "keep_last": 100}
    )
    ref = run_to_end(one, tmp_path / "ref")
    s, got, sent, started = _paced_run(small_dataset, tmp_path / "run", every=2, steps=steps)
    assert s["final_hash"] == ref["final_hash"]
    mine, theirs = _checkpoints(tmp_path / "run"), _checkpoints(tmp_path / "ref")
    for step, path in mine.items():
        assert _state_bits(path) == _state_bits(theirs[step]), step
    window = range(started["start_step"] + 1, got[-1]["next_step"] + 1)
    assert sum(1 for step in mine if step in window) >= 2
    assert {e["mode"] for e in got} | {e["mode"] for e in sent} == {"paced"}
    assert got[-1]["complete"] and got[-1]["part"] + 1 == len(got)


def _checkpoints(run: Path) -> dict[int, Path]:
    from perdure.checkpoint.loader import load_checkpoint

    out = {}
    for p in sorted((run / "checkpoints").glob("step-*")):
        if p.is_dir():
            out[load_checkpoint(p).step] = p
    return out


def _state_bits(path: Path) -> dict[str, bytes]:
    """Every tensor of a checkpoint's model and optimizer state, as bytes."""
    from perdure.checkpoint.loader import load_checkpoint
    from perdure.checkpoint.tensors import flatten

    ckpt = load_checkpoint(path)
    tensors, _ = flatten(ckpt.model, ckpt.optimizer)
    return {
        k: v.contiguous().view(-1).view(torch.uint8).numpy().tobytes() for k, v in tensors.items()
    }


def test_a_paced_receiver_cut_off_by_another_kill_copies_again_whole(
    small_dataset: Path, tmp_path: Path
) -> None:
    """A second kill lands inside the paced copy's window: the spare, partial, reports no
    state, so the next epoch copies it again from its first part (it is never a source),
    and the final parameters are still the one-worker run's."""
    kill = STEPS // 3
    faults = [
        {"kind": "kill", "target": "r0-1", "at_step": kill},
        {"kind": "kill", "target": "r0-2", "at_step": kill + 3},
    ]
    ref = run_to_end(small_config(small_dataset, workers=1, steps=STEPS), tmp_path / "ref")
    run = tmp_path / "run"
    s, _, _, _ = _paced_run(small_dataset, run, every=STEPS, faults=faults)
    assert s["final_hash"] == ref["final_hash"]
    got = [e for e in events(run, "state_received") if e["worker"] == "spare-0"]
    epochs = sorted({e["epoch"] for e in got})
    assert len(epochs) >= 2, got
    cut = [e for e in got if e["epoch"] == epochs[0]]
    assert not cut[-1]["complete"]  # the first copy did not complete
    again = [e for e in got if e["epoch"] == epochs[1]]
    assert again[0]["part"] == 0
    started = {e["epoch"]: e for e in events(run, "epoch_started")}
    assert "spare-0" in started[epochs[1]]["receivers"]
    assert started[epochs[1]]["source"] != "spare-0"


_DRAINED = """
import json, sys
from pathlib import Path
sys.path.insert(0, sys.argv[3])
from tests.runtime_support import run_to_end, small_config
cfg = small_config(Path(sys.argv[1]), workers=3, steps=int(sys.argv[4]), **json.loads(sys.argv[5]))
run_to_end(cfg, Path(sys.argv[2]), timeout_s=120)
"""


def test_a_drain_inside_a_paced_copy_completes_it_before_the_final_checkpoint(
    small_dataset: Path, tmp_path: Path
) -> None:
    """SIGTERM to the launcher as the spare's paced copy begins (a part per parameter of a
    four-layer model: about 50 steps): the run drains at a step inside the window, whose
    final save and hash need every member's whole state, so the parts left go at once
    (``flushed``), and the final checkpoint holds the bits of a one-worker run's
    checkpoint of the same step."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from perdure import events as ev
    from perdure.checkpoint import latest_checkpoint

    steps = 400
    optim = {"warmup_steps": 5, "schedule": "constant"}
    task = {"options": {"d_model": 32, "n_layers": 4, "n_heads": 2, "dropout": 0.1, "max_len": 128}}
    sections = {
        "task": task,
        "cluster": {"spares": 1, "copy_pace": "fixed", "copy_step_mb": 1e-6},
        "chaos": {"faults": [{"kind": "kill", "target": "r0-1", "at_step": 30}]},
        "checkpoint": {"every_steps": steps, "keep_last": 5},
        "optim": optim,
    }
    root = str(Path(__file__).resolve().parents[2])
    run = tmp_path / "run"
    argv = [sys.executable, "-c", _DRAINED, str(small_dataset), str(run), root, str(steps)]
    launcher = subprocess.Popen([*argv, json.dumps(sections)])
    try:
        end = time.monotonic() + 90
        while not [e for e in events(run, "state_received") if e["worker"] == "spare-0"]:
            assert time.monotonic() < end and launcher.poll() is None, "no copy began"
            time.sleep(0.02)
        launcher.send_signal(signal.SIGTERM)
        assert launcher.wait(60) == 0
    finally:
        if launcher.poll() is None:
            launcher.kill()
    [drain] = events(run, ev.RUN_DRAINING)
    got = [e for e in events(run, "state_received") if e["worker"] == "spare-0"]
    assert [e["mode"] for e in got] == ["paced"] * (len(got) - 1) + ["flushed"], got
    assert got[-1]["complete"] and not got[-2]["complete"]
    assert got[-1]["next_step"] == drain["step"]
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None
    # A constant rate: the reference's schedule does not depend on its shorter length.
    ref = small_config(small_dataset, workers=1, steps=drain["step"], task=task, optim=optim)
    run_to_end(ref, tmp_path / "ref")
    mine, theirs = _checkpoints(run), _checkpoints(tmp_path / "ref")
    assert max(mine) == max(theirs) == drain["step"]
    assert _state_bits(ckpt) == _state_bits(theirs[drain["step"]])


def test_a_poisoned_part_inside_a_paced_copy_is_quarantined_as_in_the_reference(
    small_dataset: Path, tmp_path: Path
) -> None:
    """A part of the data set yields NaN three steps into the spare's paced copy: the bad
    slot is re-run on a member whose state is whole (never the partial spare), the part
    is quarantined exactly as in the one-worker run with the same poison, and the final
    parameters are that run's."""
    poison = {"kind": "poison_part", "target": "3", "at_step": STEPS // 3 + 3}
    kill = {"kind": "kill", "target": "r0-1", "at_step": STEPS // 3}
    one = small_config(small_dataset, workers=1, steps=STEPS, chaos={"faults": [poison]})
    ref = run_to_end(one, tmp_path / "ref")
    s, got, _, started = _paced_run(
        small_dataset, tmp_path / "run", every=STEPS, faults=[kill, poison]
    )
    assert s["final_hash"] == ref["final_hash"]
    decisions = [{k: v for k, v in d.items() if k not in ("t", "event")} for d in s["decisions"]]
    theirs = [{k: v for k, v in d.items() if k not in ("t", "event")} for d in ref["decisions"]]
    assert decisions == theirs != []
    window = range(started["start_step"], got[-1]["next_step"] + 1)
    assert all(d["step"] in window for d in decisions), (decisions, window)
