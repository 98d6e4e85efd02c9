"""A full disk costs checkpoints and log lines, never the run or a bit of its result."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from perdure.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint
from perdure.events import JsonLines, Tail, read_jsonl
from tests.disk_support import small_tmpfs
from tests.runtime_support import run_to_end, small_config


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs: room for a few checkpoints of the small model, not for the run."""
    with small_tmpfs(tmp_path, 3) as mnt:
        yield mnt


def test_a_run_whose_checkpoint_disk_fills_up_ends_bitwise_equal_with_its_last_good_one(
    small_disk: Path, small_dataset: Path, tmp_path: Path
) -> None:
    """The checkpoints fill the disk (their directory is on the small tmpfs; the logs are
    not, so that the final hashes reach the summary). Log writes on a full disk are the
    next test's."""
    steps = 60
    cfg = small_config(
        small_dataset, workers=2, steps=steps, checkpoint={"every_steps": 5, "keep_last": 100}
    )
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "checkpoints").symlink_to(small_disk)
    s = run_to_end(cfg, rd, resume=None, timeout_s=120)
    ref = run_to_end(small_config(small_dataset, workers=1, steps=steps), tmp_path / "ref")
    assert s["final_hash"] == ref["final_hash"]
    found = latest_checkpoint(small_disk)
    # Each failed save made room (oldest first, never the newest good one), so the final
    # save, retried once, commits despite keep_last = 100.
    assert found is not None and int(found.name.split("-")[1]) == steps
    load_checkpoint(found)
    assert [e for e in read_jsonl(rd / "events.jsonl") if e["event"] == "checkpoint_failed"]


def test_a_log_write_that_fails_drops_the_record_and_a_torn_line_is_skipped(
    tmp_path: Path,
) -> None:
    path = tmp_path / "events.jsonl"
    path.write_bytes(b'{"t": 1, "event": "join"}\n{"t": 2, "eve')  # a write cut short
    log = JsonLines(path)
    log.write({"event": "join", "worker": "a"})
    assert [r.get("worker") for r in read_jsonl(path)] == [None]  # the torn one ate "a"
    assert [r["t"] for r in Tail(path).read()] == [1]
    log.path = tmp_path / "missing-dir" / "x.jsonl"  # the file system refuses the write
    log.write({"event": "join", "worker": "b"})
    assert log.dropped == 1


@pytest.fixture
def disk_40m(tmp_path: Path) -> Iterator[Path]:
    """A 40 MiB tmpfs for the whole run directory (root only: CI runs as root)."""
    mnt = tmp_path / f"disk40-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=40m", "tmpfs", str(mnt)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.decode()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_a_run_directory_on_a_full_disk_completes_with_the_clean_hash_and_resumes(
    disk_40m: Path, small_dataset: Path, tmp_path: Path
) -> None:
    """Run directory (logs, lease, checkpoints) on 40 MiB, ~11.9 MB checkpoints saved every
    5 steps, keep_last = 3: the fourth save finds the disk full. Each failed save leaves no
    ``.tmp-`` directory, says which file system is full and makes room; the lease never
    needs free space; the run ends with the clean run's hash, its summary and report."""
    steps = 40
    task = {"options": {"d_model": 160, "n_layers": 3, "n_heads": 2, "dropout": 0.1,
                        "max_len": 128}}  # fmt: skip
    ckpt = {"every_steps": 5, "keep_last": 3}
    cfg = small_config(small_dataset, workers=2, steps=steps, task=task, checkpoint=ckpt)
    rd = disk_40m / "run"
    s = run_to_end(cfg, rd, timeout_s=240)
    ref = run_to_end(
        small_config(small_dataset, workers=1, steps=steps, task=task, checkpoint=ckpt),
        tmp_path / "ref",
    )
    assert s["final_hash"] == ref["final_hash"]
    assert (rd / "summary.json").exists() and (rd / "report.html").exists()
    assert not [p for p in (rd / "checkpoints").iterdir() if ".tmp-" in p.name]
    failed = [e for e in read_jsonl(rd / "events.jsonl") if e["event"] == "checkpoint_failed"]
    assert failed, "the disk never filled: the test no longer tests anything"
    for e in failed:
        assert "No space left on device" in e["error"]
        assert e["error"].startswith(f"the file system of {disk_40m} is full")
        assert e["needed_bytes"] > e["free_bytes"] and e["pruned"]
    found = latest_checkpoint(rd / "checkpoints")  # verifies every checksum
    assert found is not None and found.name == f"step-{steps:09d}"
    assert not [e for e in read_jsonl(rd / "events.jsonl") if e["event"] == "lease_unavailable"]
    # The newest committed checkpoint resumes: the final one holds the end (verified
    # above); the one before it, written on the full disk, resumes to the same hash.
    before = list_checkpoints(rd / "checkpoints")[-2]
    again = run_to_end(cfg, tmp_path / "resumed", resume=str(before), timeout_s=240)
    assert again["final_hash"] == ref["final_hash"]


def test_the_lease_renews_on_a_full_disk_in_the_space_it_reserved(disk_40m: Path) -> None:
    from perdure.runtime.control.lease import FileLease, Granted, LeaseView

    lease = FileLease(disk_40m, ttl_s=2.0)
    got = lease.acquire(LeaseView(), 0, {"instance": "a"})
    assert isinstance(got, Granted)
    filler = open(disk_40m / "filler", "wb")  # noqa: SIM115 (fill to the last block)
    with filler as f, pytest.raises(OSError, match="No space left on device"):
        while True:
            f.write(b"\0" * (1 << 20))
            f.flush()
    for _ in range(20):
        assert isinstance(lease.renew(got.generation), Granted)
    assert lease.observe().version == 20
    lease.end(got.generation)
    assert lease.observe().state == "ended"
