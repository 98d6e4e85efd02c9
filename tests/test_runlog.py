"""Per-process log parts and their merge: no file of a run has two writers."""

from __future__ import annotations

import json
import multiprocessing as mp
from pathlib import Path

from perdure import events as ev
from perdure.events import read_jsonl
from perdure.runlog import STATE, Merger, merge_all, part, writer_id


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
    state = json.loads((tmp_path / "events.d" / STATE).read_text())
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
