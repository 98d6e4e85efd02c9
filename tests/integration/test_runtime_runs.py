"""End-to-end runs with real processes: the final parameters do not depend on who computed."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from perdure.run_config import with_overrides
from tests.runtime_support import events, run_to_end, small_config

STEPS = 30


@pytest.fixture(scope="module")
def reference(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The one-worker run every other run must match bit for bit."""
    run_dir = tmp_path_factory.mktemp("ref")
    s = run_to_end(small_config(small_dataset, workers=1, steps=STEPS), run_dir)
    return {**s, "run_dir": run_dir}


def test_one_worker_run_commits_every_step_and_the_loss_falls(reference: dict) -> None:
    assert reference["steps"] == STEPS and reference["survivor_restarts"] == 0
    assert reference["final_hash"].startswith("sha256:")
    from perdure.events import read_jsonl

    losses = [m["loss"] for m in read_jsonl(reference["run_dir"] / "metrics.jsonl")]
    assert [m["step"] for m in read_jsonl(reference["run_dir"] / "metrics.jsonl")] == list(
        range(STEPS)
    )
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < first - 0.5, f"loss did not fall: {first:.3f} -> {last:.3f}"


@pytest.mark.parametrize("workers,regions", [(2, 1), (4, 2)])
def test_worker_count_does_not_change_final_weights(
    reference: dict, small_dataset: Path, tmp_path: Path, workers: int, regions: int
) -> None:
    cfg = small_config(small_dataset, workers=workers, regions=regions, steps=STEPS)
    s = run_to_end(cfg, tmp_path)
    assert s["final_hash"] == reference["final_hash"]
    assert s["membership_changes"] == 0 and s["survivor_restarts"] == 0, events(tmp_path)


def test_resume_with_another_worker_count_follows_the_same_trajectory(
    reference: dict, small_dataset: Path, tmp_path: Path
) -> None:
    half = reference["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    assert half.is_dir()
    cfg = small_config(small_dataset, workers=3, regions=2, steps=STEPS)
    s = run_to_end(cfg, tmp_path, resume=str(half))
    assert s["final_hash"] == reference["final_hash"]
    first = min(e["start_step"] for e in events(tmp_path, "epoch_started"))
    assert first == STEPS // 2


def test_a_new_run_into_a_used_run_dir_is_refused(reference: dict, small_dataset: Path) -> None:
    from perdure.launch.api import run

    cfg = small_config(small_dataset, workers=1, steps=STEPS)
    with pytest.raises(FileExistsError, match=r"already holds a run .* --resume latest"):
        run(cfg, run_dir=reference["run_dir"])


def test_resume_latest_in_the_interrupted_runs_own_dir_follows_the_same_trajectory(
    reference: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """The directory keeps everything of the first run (its events, even its end, and its
    coordinator's stale ports file); the resumed run must act on its own only."""
    rd = tmp_path / "run"
    shutil.copytree(reference["run_dir"], rd)
    shutil.rmtree(rd / "checkpoints" / f"step-{STEPS:09d}")
    (rd / "summary.json").unlink()
    assert (rd / "coordinator.json").exists() and events(rd, "run_end")
    cfg = small_config(small_dataset, workers=2, steps=STEPS)
    s = run_to_end(cfg, rd, resume="latest")
    assert s["final_hash"] == reference["final_hash"]
    assert s["steps"] == STEPS // 2 and s["survivor_restarts"] == 0
    assert len(events(rd, "run_start")) == 2


def test_resume_under_another_config_is_refused_naming_both_hashes(
    reference: dict, small_dataset: Path, tmp_path: Path
) -> None:
    from perdure.checkpoint import IncompatibleCheckpointError
    from perdure.runtime.replica.trainer import Trainer

    half = reference["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}"
    cfg = small_config(small_dataset, workers=1, steps=STEPS)
    other = with_overrides(cfg, optim={"lr": 1e-4})
    trainer = Trainer(other, cache_dir=str(tmp_path))
    with pytest.raises(IncompatibleCheckpointError, match=r"optim\.lr"):
        trainer.load(half)
    trainer.close()


def test_a_config_change_at_resume_runs_only_when_allowed_and_is_recorded(
    reference: dict, small_dataset: Path, tmp_path: Path
) -> None:
    from perdure.checkpoint import latest_checkpoint, load_checkpoint
    from perdure.launch.api import run
    from perdure.launch.preflight import PreflightError

    half = str(reference["run_dir"] / "checkpoints" / f"step-{STEPS // 2:09d}")
    other = small_config(small_dataset, workers=2, steps=STEPS, optim={"lr": 1e-4})
    with pytest.raises(PreflightError, match=r"optim\.lr.*--allow-config-change"):
        run(other, run_dir=tmp_path / "refused", resume=half)
    assert not (tmp_path / "refused").exists()
    s = run(other, run_dir=tmp_path / "run", resume=half, allow_config_change=True, timeout_s=50)
    assert s["steps"] == STEPS // 2 and s["final_hash"] != reference["final_hash"]
    [logged] = [d for d in s["decisions"] if d["kind"] == "config_override"]
    # the default optimizer's param group carries the new rate too: the recipe changed
    changed = ["identity.recipe.param_groups.0.lr", "optim.lr"]
    assert logged["step"] == STEPS // 2 and logged["details"]["keys"] == changed
    final = latest_checkpoint(tmp_path / "run" / "checkpoints")
    assert final is not None
    recorded = [d for d in load_checkpoint(final).decisions if d["kind"] == "config_override"]
    assert recorded == [{k: v for k, v in logged.items() if k not in ("t", "event", "by")}]


def test_killed_worker_does_not_change_final_weights(
    reference: dict, small_dataset: Path, tmp_path: Path
) -> None:
    """4 workers and a warm spare; one worker is SIGKILLed at T/3. The spare takes its
    slots at once after copying a live peer's state; the killed one's replacement joins
    later the same way."""
    steps = STEPS * 4
    faults = [{"kind": "kill", "target": "r1-0", "at_step": steps // 3}]
    cfg = small_config(
        small_dataset,
        workers=4,
        regions=2,
        steps=steps,
        cluster={"spares": 1},
        chaos={"faults": faults},
    )
    ref = run_to_end(small_config(small_dataset, workers=1, steps=steps), tmp_path / "ref")
    s = run_to_end(cfg, tmp_path / "run")
    assert s["final_hash"] == ref["final_hash"]
    assert s["survivor_restarts"] == 0
    assert [e["worker"] for e in events(tmp_path / "run", "leave")] == ["r1-0"]
    assert [e["worker"] for e in events(tmp_path / "run", "spare_promoted")] == ["spare-0"]
    received = {e["worker"]: e for e in events(tmp_path / "run", "state_received")}
    assert received["spare-0"]["next_step"] >= steps // 3
    started = events(tmp_path / "run", "epoch_started")
    assert started[1]["start_step"] >= steps // 3 and "spare-0" in started[1]["plan"]["members"]


def test_graceful_stop_and_a_later_join_do_not_change_final_weights(
    small_dataset: Path, tmp_path: Path
) -> None:
    """4 workers; one leaves gracefully (SIGTERM) at T/3 and a new process joins later."""
    steps = STEPS * 10
    faults = [{"kind": "stop", "target": "r1-0", "at_step": steps // 3, "duration_s": 0.5}]
    cfg = small_config(small_dataset, workers=4, regions=2, steps=steps, chaos={"faults": faults})
    ref = run_to_end(small_config(small_dataset, workers=2, steps=steps), tmp_path / "ref")
    s = run_to_end(cfg, tmp_path / "run")
    assert s["final_hash"] == ref["final_hash"]
    assert s["survivor_restarts"] == 0 and s["steps_lost"] == 0
    run = tmp_path / "run"
    assert [e["worker"] for e in events(run, "leave_requested")] == ["r1-0"]
    assert [e["worker"] for e in events(run, "left")] == ["r1-0"]
    epochs = events(run, "epoch_started")
    without = next(e for e in epochs if "r1-0" not in e["plan"]["members"])
    # the survivors keep their state; only one still inside the step the leaver had just
    # committed when the leave was announced abandons it (should_stop: that step is at or
    # past the announcement's ``after``) and copies a peer's (seen once in a full run)
    caught = {e["worker"] for e in events(run, "step_abandoned") if e["epoch"] < without["epoch"]}
    assert without["start_step"] >= steps // 3 and set(without["receivers"]) <= caught
    rejoined = [e for e in events(run, "state_received") if e["worker"] == "r1-0"]
    assert rejoined and rejoined[0]["next_step"] > without["start_step"]


def test_a_warm_up_pass_does_not_change_the_next_steps_bits(
    small_dataset: Path, tmp_path: Path
) -> None:
    """Spares and joiners run one throwaway slot before they may be promoted; the steps
    they then compute (dropout included) must be the bits a cold replica computes."""
    from perdure.runtime.replica.trainer import Trainer

    cfg = small_config(small_dataset, workers=1, steps=STEPS)
    cold, warm = Trainer(cfg, cache_dir=str(tmp_path)), Trainer(cfg, cache_dir=str(tmp_path))
    warm.warm_up()
    for step in (0, 1):
        sums = []
        for t in (cold, warm):
            bufs = [t.engine.new_buffer() for _ in range(cfg.train.slots)]
            assert t.compute_slots(step, range(cfg.train.slots), bufs)
            assert bufs[0].abs().sum() > 0
            sums.append(torch.stack(bufs))
            t.apply(step, sum(bufs[1:], bufs[0].clone()))
        assert torch.equal(sums[0], sums[1])
        assert cold.digest() == warm.digest()
    cold.close()
    warm.close()
