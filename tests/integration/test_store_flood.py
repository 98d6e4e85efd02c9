"""A flood of unauthenticated, dribbling connections to the store, while a worker is
killed, changes nothing: steps keep committing, every save succeeds, the final hash is
the clean run's, and the event log grows by a line a second at most."""

from __future__ import annotations

import itertools
import json
import resource
import socket
import threading
import time
from pathlib import Path

from perdure import events as ev
from perdure.events import read_jsonl
from tests.runtime_support import events, run_to_end, small_config

STEPS = 200
FLOOD = 1100
DRIBBLE_S = 3.0


def _ports(run_dir: Path, stop: threading.Event) -> dict | None:
    while not stop.is_set():
        try:
            return json.loads((run_dir / "coordinator.json").read_text())
        except (OSError, ValueError):
            time.sleep(0.05)
    return None


def _open(addr: tuple[str, int]) -> socket.socket | None:
    try:
        s = socket.create_connection(addr, timeout=2)
        s.setblocking(False)
        return s
    except OSError:
        return None


def _flood(run_dir: Path, stop: threading.Event, report: dict) -> None:
    """FLOOD connections that never authenticate; one byte each every DRIBBLE_S; a closed
    one is opened again, so FLOOD stay knocking for the whole run."""
    ports = _ports(run_dir, stop)
    if ports is None:
        return
    addr = (ports["host"], int(ports["store_port"]))
    socks: list[socket.socket | None] = [None] * FLOOD
    while not stop.is_set():
        for i, s in enumerate(socks):
            if stop.is_set():
                break
            try:
                if s is None:
                    raise OSError
                s.send(b"P")
            except OSError:
                if s is not None:
                    s.close()
                socks[i] = _open(addr)
                report["opened"] += 1
        report["rounds"] += 1
        stop.wait(DRIBBLE_S)
    for s in socks:
        if s is not None:
            s.close()


def test_a_store_flood_during_a_worker_kill_changes_no_bit(
    small_dataset: Path, tmp_path: Path
) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 4096)), hard))
    cfg = dict(steps=STEPS, workers=3, checkpoint={"every_steps": 25, "keep_last": 3})
    ref = run_to_end(small_config(small_dataset, **cfg), tmp_path / "ref")  # type: ignore[arg-type]
    # Killed between two saves (every 25 steps): a save in flight when a member dies is
    # abandoned by design ("membership changed"), which is not what this test is about.
    kill = {"faults": [{"kind": "kill", "target": "r0-1", "at_step": STEPS // 2 + 12}]}
    rd = tmp_path / "run"
    stop, report = threading.Event(), {"opened": 0, "rounds": 0}
    flooder = threading.Thread(target=_flood, args=(rd, stop, report), daemon=True)
    flooder.start()
    try:
        s = run_to_end(small_config(small_dataset, chaos=kill, **cfg), rd)  # type: ignore[arg-type]
    finally:
        stop.set()
        flooder.join(30)
    assert s["final_hash"] == ref["final_hash"]
    assert report["opened"] >= FLOOD and report["rounds"] >= 2, report
    assert events(rd, ev.CHECKPOINT_FAILED) == []
    assert [e["worker"] for e in events(rd, ev.LEAVE)] == ["r0-1"]
    times: dict[int, float] = {}
    for m in read_jsonl(rd / "metrics.jsonl"):
        times.setdefault(int(m["step"]), float(m["t"]))
    steps = sorted(times)
    assert steps[-1] == STEPS - 1
    gaps = [times[b] - times[a] for a, b in itertools.pairwise(steps)]
    assert max(gaps) < 5.0, max(gaps)
    refused = [e for e in events(rd, ev.REFUSED) if e.get("door") == "store"]
    assert sum(e["count"] for e in refused) > 0
    span = max(e["t"] for e in events(rd)) - min(e["t"] for e in events(rd))
    assert len(events(rd, ev.REFUSED)) <= 2 * (span + 2)  # a line a second per door at most
