"""A full disk costs checkpoints and log lines, never the run or a bit of its result."""

from __future__ import annotations

import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from perdure.checkpoint import latest_checkpoint, load_checkpoint
from perdure.events import JsonLines, Tail, read_jsonl
from tests.runtime_support import run_to_end, small_config


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 3 MiB tmpfs: room for a few checkpoints of the small model, not for the run."""
    mnt = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mnt.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {made.stderr.decode()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


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
    assert found is not None and int(found.name.split("-")[1]) < steps
    load_checkpoint(found)  # the last good one is whole
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
