"""Per-process log parts and their merge: no file of a run has two writers."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

from perdure import events as ev
from perdure.events import read_jsonl
from perdure.runlog import Merger, merge_all, newest_record, part, writer_id


def _record(run_dir: Path, log: str) -> dict[str, Any]:
    state = newest_record(run_dir / f"{log}.d")
    assert state is not None
    return state


def _write(run_dir: str, name: str, n: int) -> None:
    log = part(run_dir, "events", writer_id(name))
    for i in range(n):
        log.write({"event": ev.JOIN, "worker": name, "i": i})


def test_parts_from_many_processes_merge_into_one_log_each_in_order_with_no_line_lost(
    tmp_path: Path,
) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_write, args=(str(tmp_path), f"w{k}", 200)) for k in range(4)]
    for p in procs:
        p.start()
    m = Merger(tmp_path, "events")
    while any(p.is_alive() for p in procs):
        m.merge()  # merging while they write
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    m.merge(final=True)
    merged = read_jsonl(tmp_path / "events.jsonl")
    assert len(merged) == 800
    for k in range(4):
        assert [r["i"] for r in merged if r["worker"] == f"w{k}"] == list(range(200))
    # (order across writers is by t within a merge; a writer preempted between stamping
    # and writing a line lands in a later merge, as it landed later in one shared file)
    assert len(list((tmp_path / "events.d").glob("*.jsonl"))) == 4  # one part per process


def test_a_new_merger_goes_on_where_the_last_stopped_and_drops_an_unrecorded_append(
    tmp_path: Path,
) -> None:
    log = part(tmp_path, "events", "coordinator.a")
    for i in range(3):
        log.write({"event": ev.JOIN, "i": i})
    Merger(tmp_path, "events").merge(final=True)
    # the merger died between its append and its record of it: a half-written line
    with open(tmp_path / "events.jsonl", "ab") as f:
        f.write(b'{"t": 1, "event": "join", "i": 2}\n{"t": 1, "eve')
    for i in range(3, 5):
        log.write({"event": ev.JOIN, "i": i})
    Merger(tmp_path, "events").merge(final=True)  # e.g. a standby that took over
    assert [r["i"] for r in read_jsonl(tmp_path / "events.jsonl")] == [0, 1, 2, 3, 4]
    state = _record(tmp_path, "events")
    assert state["size"] == (tmp_path / "events.jsonl").stat().st_size


def test_a_line_still_being_written_waits_for_the_next_merge(tmp_path: Path) -> None:
    path = tmp_path / "metrics.d" / "w0.jsonl"
    path.parent.mkdir()
    path.write_bytes(b'{"t": 1.0, "step": 0}\n{"t": 2.0, "st')
    merge_all(tmp_path, final=True)
    assert read_jsonl(tmp_path / "metrics.jsonl") == [{"t": 1.0, "step": 0}]
    with open(path, "ab") as f:
        f.write(b'ep": 1}\n')
    merge_all(tmp_path, final=True)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [0, 1]


def test_a_regular_merge_holds_back_lines_stamped_after_it_began(tmp_path: Path) -> None:
    path = tmp_path / "events.d" / "w0.jsonl"
    path.parent.mkdir()
    path.write_text('{"t": 1.0, "event": "join"}\n{"t": 9e12, "event": "leave"}\n')
    m = Merger(tmp_path, "events")
    assert m.merge() == 1  # the far-future line is not yet in order with the others
    assert m.merge(final=True) == 1
    assert [r["event"] for r in read_jsonl(tmp_path / "events.jsonl")] == ["join", "leave"]


def _steps(log: Any, steps: range, **extra: Any) -> None:
    for s in steps:
        log.write({"step": s, "loss": float(s), **extra})


def test_every_member_logs_its_steps_and_the_merge_keeps_each_step_once(tmp_path: Path) -> None:
    """Rank 0 (w0) abandoned step 5, which the others committed: their lines carry it."""
    w0, w1, w2 = (part(tmp_path, "metrics", f"w{k}") for k in range(3))
    for log, steps in ((w0, range(5)), (w1, range(8)), (w2, range(8))):
        _steps(log, steps)
    m = Merger(tmp_path, "metrics")
    m.merge(final=True)
    _steps(w1, range(8, 10))
    Merger(tmp_path, "metrics").merge(final=True)  # a standby taking over goes on
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == list(range(10))
    state = _record(tmp_path, "metrics")
    assert state["last_step"] == 9


def test_a_new_launch_logs_the_steps_it_redoes_and_a_rollback_does_not(tmp_path: Path) -> None:
    w = part(tmp_path, "metrics", "w0")
    _steps(w, range(6))
    _steps(w, range(3, 8), rollback=True)  # redone after a rollback: the same bits
    Merger(tmp_path, "metrics").merge(final=True)
    first = read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in first] == list(range(8))
    assert [r.get("rollback", False) for r in first] == [False] * 6 + [True] * 2
    # resumed in its own directory from step 4: the new launch's lines are all kept
    _steps(part(tmp_path, "metrics", "w0-resumed"), range(4, 10))
    Merger(tmp_path, "metrics", new_launch=True).merge(final=True)
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [
        *range(8),
        *range(4, 10),
    ]


def test_events_are_never_deduplicated_by_step(tmp_path: Path) -> None:
    log = part(tmp_path, "events", "w0")
    for _ in range(2):
        log.write({"event": ev.STEP_ABANDONED, "step": 3})
    merge_all(tmp_path, final=True)
    assert [r["step"] for r in read_jsonl(tmp_path / "events.jsonl")] == [3, 3]


def test_a_cut_off_primary_still_merging_stands_down_for_the_standby_that_took_over(
    tmp_path: Path,
) -> None:
    """Generation 1 merges; generation 2 takes over while 1 still runs (cut off from its
    workers, not from the disk); 1's next merge finds 2 recorded and stands down instead
    of writing over 2's lines, and 2 merges every part, 1's own included."""
    old = part(tmp_path, "events", "coordinator.a")
    new = part(tmp_path, "events", "standby.b")
    old.write({"event": ev.JOIN, "i": 0})
    primary = Merger(tmp_path, "events", new_launch=True, generation=1)
    assert primary.merge(final=True) == 1
    standby = Merger(tmp_path, "events", generation=2)
    new.write({"event": ev.COORDINATOR_TAKEOVER, "i": 1})
    old.write({"event": ev.JOIN, "i": 2})
    assert primary.merge(final=True) == 0 and primary.stood_down
    assert standby.merge(final=True) == 2
    old.write({"event": ev.JOIN, "i": 3})
    assert primary.merge(final=True) == 0  # for good
    assert standby.merge(final=True) == 1
    assert [r["i"] for r in read_jsonl(tmp_path / "events.jsonl")] == [0, 1, 2, 3]
    assert _record(tmp_path, "events")["generation"] == 2
    merge_all(tmp_path, final=True)  # the launcher's last merge claims nothing
    assert _record(tmp_path, "events")["generation"] == 2
    relaunch = Merger(tmp_path, "events", new_launch=True, generation=1)  # a new lease store
    old.write({"event": ev.JOIN, "i": 4})
    assert relaunch.merge(final=True) == 1 and not relaunch.stood_down


def _stop_inside_a_merge(run_dir: str) -> None:
    """A primary's merger (generation 1) that SIGSTOPs itself inside its append, after it
    opened the merged file and checked for a newer claim, holding the lock."""
    import signal

    import perdure.runlog as runlog

    m = Merger(run_dir, "events", new_launch=True, generation=1)
    part(run_dir, "events", "coordinator.a").write({"event": ev.JOIN, "i": 1})
    real = os.fsync

    def stop_then_sync(fd: int) -> None:
        os.kill(os.getpid(), signal.SIGSTOP)
        real(fd)

    runlog.os.fsync = stop_then_sync  # type: ignore[attr-defined]
    m.merge(final=True)  # stopped in here; woken, its write went to the replaced file
    runlog.os.fsync = real  # type: ignore[attr-defined]
    part(run_dir, "events", "coordinator.a").write({"event": ev.JOIN, "i": 3})
    assert m.merge(final=True) == 0 and m.stood_down


def test_a_primary_stopped_inside_its_merge_neither_stalls_the_standby_nor_overwrites_it(
    tmp_path: Path,
) -> None:
    """The hung primary holds the merge lock; the standby (generation 2) takes over within
    the lock's timeout, merges every part from the recorded offsets, and the primary's
    append, finished once it wakes, lands in the file the takeover replaced: the merged
    log holds each line once."""
    import signal
    import time

    part(tmp_path, "events", "coordinator.a").write({"event": ev.JOIN, "i": 0})
    Merger(tmp_path, "events").merge(final=True)
    ctx = mp.get_context("fork")
    proc = ctx.Process(target=_stop_inside_a_merge, args=(str(tmp_path),))
    proc.start()
    try:
        deadline = time.monotonic() + 30
        while not _stopped(proc.pid):
            assert time.monotonic() < deadline and proc.is_alive(), "never stopped"
            time.sleep(0.01)
        standby = Merger(tmp_path, "events", generation=2)  # does not wait for the lock
        assert standby.owns
        part(tmp_path, "events", "standby.b").write({"event": ev.COORDINATOR_TAKEOVER, "i": 2})
        assert standby.merge(final=True) == 2  # the primary's unrecorded line, and its own
        os.kill(proc.pid, signal.SIGCONT)
        proc.join(30)
        assert proc.exitcode == 0
        assert standby.merge(final=True) == 1  # the primary's last line, from its part
    finally:
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGKILL)
    assert [r["i"] for r in read_jsonl(tmp_path / "events.jsonl")] == [0, 1, 2, 3]
    assert _record(tmp_path, "events")["generation"] == 2
    assert _record(tmp_path, "events")["size"] == (tmp_path / "events.jsonl").stat().st_size


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (OSError, IndexError):
        return False


def test_a_merger_that_claims_nothing_skips_a_merge_while_the_lock_is_held(
    tmp_path: Path,
) -> None:
    """The launcher's or a tool's merge does not wait on a stopped holder past the lock's
    timeout: it merges nothing, and everything once the lock is free."""
    import fcntl

    log = part(tmp_path, "events", "w0")
    log.write({"event": ev.JOIN, "i": 0})
    (tmp_path / "events.d").mkdir(exist_ok=True)
    fd = os.open(tmp_path / "events.d" / "merge.lock", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)  # another open file: conflicts even in this process
    try:
        m = Merger(tmp_path, "events")
        assert not m.ready and m.merge(final=True) == 0
        assert not (tmp_path / "events.jsonl").exists()
    finally:
        os.close(fd)
    assert m.merge(final=True) == 1
    assert [r["i"] for r in read_jsonl(tmp_path / "events.jsonl")] == [0]
