"""The storage fault kinds of the chaos registry, injected by a schedule: a corrupt part
(repaired from a mirror, or quarantined as ``corrupt``), slow storage and a full disk are
absorbed, and where the bits cannot change the run ends with the clean run's final hash."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from perdure import events as ev
from perdure.checkpoint import latest_checkpoint, load_checkpoint
from perdure.data import Dataset, SlotLoader
from tests.disk_support import small_tmpfs
from tests.runtime_support import events, run_to_end, small_config

STEPS = 30
SEED = 1234  # train.seed's default: the data order of the runs below


def _config(dataset: Path, faults: list[dict[str, Any]], **sections: Any) -> Any:
    sections.setdefault("checkpoint", {"every_steps": 10})
    return small_config(dataset, workers=2, steps=STEPS, chaos={"faults": faults}, **sections)


@pytest.fixture(scope="module")
def clean(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    return run_to_end(_config(small_dataset, []), tmp_path_factory.mktemp("clean"))


def _fault(s: dict, kind: str) -> dict:
    [f] = [f for f in s["faults"] if f["kind"] == kind]
    return f


def _first_use_from(dataset: Path, part: int, step: int) -> dict:
    """The first step from ``step`` on whose samples include ``part``: its slots and
    those samples (slots of 2, global batch 16, as ``small_config``)."""
    with (
        Dataset.open(str(dataset)) as ds,
        SlotLoader(ds, seed=SEED, global_batch=16, slots=8, prefetch_steps=0) as loader,
    ):
        for t in range(step, step + 1000):
            hit = {s: loader.samples(t, s) for s in range(8)}
            hit = {s: ids[ds.part_of(ids) == part] for s, ids in hit.items()}
            hit = {s: ids for s, ids in hit.items() if ids.size}
            if hit:
                samples = sorted(int(i) for ids in hit.values() for i in ids)
                return {"step": t, "slots": sorted(hit), "samples": samples}
    raise AssertionError(f"part {part} unused after step {step}")


# -- corrupt_part ---------------------------------------------------------------------------


def test_a_scheduled_corrupt_part_with_a_mirror_ends_with_the_clean_runs_final_hash(
    clean: dict, small_dataset: Path, tmp_path: Path
) -> None:
    mirror = tmp_path / "mirror"
    shutil.copytree(small_dataset, mirror)
    fault = {"kind": "corrupt_part", "target": "4", "at_step": 5}
    cfg = _config(small_dataset, [fault], data={"mirrors": [str(mirror)]})
    s = run_to_end(cfg, tmp_path / "run")
    assert s["final_hash"] == clean["final_hash"]
    repairs = events(tmp_path / "run", ev.PART_REPAIRED)
    assert repairs and {(r["part"], r["via"]) for r in repairs} == {(4, str(mirror))}
    assert all(r["found"] != r["manifest"] for r in repairs)
    assert events(tmp_path / "run", ev.DECISION) == []
    assert _fault(s, "corrupt_part")["absorbed"]
    [seen] = [f for f in s["failures"] if f["kind"] == "corrupt_part"]  # one per part
    assert (seen["parts"], seen["scheduled"], seen["absorbed"]) == ([4], True, True)


def test_a_scheduled_corrupt_part_with_no_mirror_is_quarantined_as_corrupt_at_its_next_use(
    small_dataset: Path, tmp_path: Path
) -> None:
    part, at = 4, 5
    fault = {"kind": "corrupt_part", "target": str(part), "at_step": at}
    cfg = _config(small_dataset, [fault], data={"on_corrupt": "quarantine"})
    s = run_to_end(cfg, tmp_path / "run")
    use = _first_use_from(small_dataset, part, at)
    [d] = events(tmp_path / "run", ev.DECISION)
    got = {k: d[k] for k in ("step", "kind", "parts", "samples", "slots")}
    assert got == {"kind": "corrupt", "parts": [part], **use}
    assert d["reason"].startswith(f"no good copy (data.on_corrupt = 'quarantine'): part {part}")
    assert _fault(s, "corrupt_part")["absorbed"]
    [seen] = [f for f in s["failures"] if f["kind"] == "corrupt_part"]
    assert (seen["parts"], seen["scheduled"], seen["absorbed"]) == ([part], True, True)


# -- slow_storage ----------------------------------------------------------------------------


def test_scheduled_slow_storage_changes_no_bit_and_evicts_nobody(
    clean: dict, small_dataset: Path, tmp_path: Path
) -> None:
    fault = {
        "kind": "slow_storage",
        "target": "r0-1",
        "at_step": 3,
        "delay_ms": 40,
        "duration_s": 2.0,
    }
    s = run_to_end(_config(small_dataset, [fault]), tmp_path / "run")
    assert s["final_hash"] == clean["final_hash"]
    [hit] = [e for e in events(tmp_path / "run", ev.FAULT_HIT) if e["kind"] == "slow_storage"]
    assert (hit["worker"], hit["delay_ms"]) == ("r0-1", 40)
    assert events(tmp_path / "run", ev.LEAVE) == []
    assert _fault(s, "slow_storage")["absorbed"]


# -- disk_full -------------------------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs for the checkpoints."""
    with small_tmpfs(tmp_path, 4) as mnt:
        yield mnt


def test_a_scheduled_full_disk_costs_saves_not_the_run_nor_a_bit(
    clean: dict, small_dataset: Path, small_disk: Path, tmp_path: Path
) -> None:
    fault = {"kind": "disk_full", "target": "r0", "at_step": 4, "duration_s": 1.5}
    # every slot read 150 ms slower (no bit changes): the run outlasts the full disk on a
    # quiet machine too, so the saves after it (the final one included) commit
    slow = {
        "kind": "slow_storage",
        "target": "r0",
        "at_step": 1,
        "delay_ms": 150,
        "duration_s": 600,
    }
    checkpoint = {"every_steps": 2, "dir": str(small_disk)}
    cfg = _config(small_dataset, [fault, slow], checkpoint=checkpoint)
    s = run_to_end(cfg, tmp_path / "run")
    assert s["final_hash"] == clean["final_hash"]
    failed = events(tmp_path / "run", ev.CHECKPOINT_FAILED)
    assert failed and all("No space left on device" in e["error"] for e in failed)
    hits = [e for e in events(tmp_path / "run", ev.FAULT_HIT) if e["kind"] == "disk_full"]
    assert {e["worker"] for e in hits} == {"r0-0", "r0-1"} and max(e["bytes"] for e in hits) > 0
    assert sorted(p.name for p in small_disk.iterdir() if not p.name.startswith("step-")) == []
    found = latest_checkpoint(small_disk)
    assert found is not None and found.name == f"step-{STEPS:09d}"
    load_checkpoint(found)
    assert _fault(s, "disk_full")["absorbed"]


# -- config ----------------------------------------------------------------------------------


def _problems(cls: Any, **fields: Any) -> list[tuple[str, str, object]]:
    from perdure.config import ConfigError

    with pytest.raises(ConfigError) as e:
        cls(**fields)
    return [(p.key, p.rule, p.value) for p in e.value.problems]


def test_each_storage_kind_states_its_own_rules() -> None:
    from perdure.chaos.config import FaultConfig

    assert _problems(FaultConfig, kind="corrupt_part", target="2", at_s=1.0) == [
        ("at_step", "corrupt_part needs a step trigger (every loader applies it at that step)",
         1.0),
    ]  # fmt: skip
    assert _problems(FaultConfig, kind="corrupt_part", target="r0-1", at_step=1) == [
        ("target", "must be a dataset part index", "r0-1")
    ]
    assert _problems(FaultConfig, kind="slow_storage", target="r0-1", at_step=1) == [
        ("delay_ms", "must be a finite number > 0", 0)
    ]
    FaultConfig(kind="disk_full", target="r0", at_step=1)  # until the worker exits


def test_the_data_configs_storage_fields_are_checked() -> None:
    from perdure.data.config import DataConfig

    got = _problems(
        DataConfig, dataset="d", mirrors=["d", ""], on_corrupt="ignore", read_attempts=0
    )
    assert got == [
        ("mirrors[1]", "must be a non-empty directory or fsspec URL", ""),
        ("mirrors", "must not hold data.dataset itself (a mirror is another copy)", "d"),
        ("on_corrupt", "must be one of ['stop', 'quarantine']", "ignore"),
        ("read_attempts", "must be an integer >= 1", 0),
    ]
