"""The coordinator's server around the policy: effects carried out in order, failures fed
back as events on a later turn, and hostile bytes that disconnect a peer, never the server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from perdure import events as ev
from perdure.run_config import RunConfig, with_overrides
from perdure.runtime.control import policy as pol
from perdure.runtime.control import protocol as p
from perdure.runtime.control.channel import connect
from perdure.runtime.control.coordinator import Coordinator
from tests.runtime_support import logged


class FakeLine:
    """A worker's line as the server sees it; ``fail_on`` makes sends of a type fail."""

    def __init__(self) -> None:
        self.sock, self.peer = socket.socketpair()
        self.sent: list[Any] = []
        self.fail_on: type | None = None

    def send(self, msg: Any) -> None:
        if self.fail_on is not None and isinstance(msg, self.fail_on):
            raise BrokenPipeError("peer gone")
        self.sent.append(msg)

    def feed(self, data: bytes) -> list[Any]:
        return []

    def close(self) -> None:
        self.sock.close()
        self.peer.close()


def _coordinator(tmp_path: Path, workers: int) -> Coordinator:
    config = with_overrides(
        RunConfig(),
        train={"slots": 6, "global_batch": 12, "steps": 50},
        cluster={"regions": [{"name": "r0", "workers": workers}]},
    )
    return Coordinator(config, run_dir=str(tmp_path), token="t", expected_workers=workers)


def _hello(name: str) -> p.Hello:
    return p.Hello(
        name=name, region="r0", role="worker", pid=1, next_step=0, has_state=True, epoch=-1, mac=""
    )


def test_a_send_failing_inside_a_start_is_handled_on_the_next_turn(tmp_path: Path) -> None:
    c = _coordinator(tmp_path, 3)
    lines = {n: FakeLine() for n in ("w0", "w1", "w2")}
    try:
        _admit(c, lines, prepared=True)
        c.queue.append(pol.Tick(time.monotonic()))
        c._drain()
        lines["w1"].fail_on = p.Start
        for name in lines:
            c.queue.append(pol.Received(name, p.Ready(epoch=0, next_step=0, has_state=True), 0.0))
        c.queue.append(pol.Tick(time.monotonic()))
        c._drain()
        pending = c.policy.pending
        assert pending is not None and pending.members == ["w0", "w2"] and pending.after == -1
        kinds = [type(m).__name__ for m in lines["w0"].sent]
        assert kinds == ["Welcome", "Announce", "Start", "Announce"]
        assert lines["w0"].sent[-1].epoch == 1
        assert "w1" not in c.lines
    finally:
        c._shutdown()


def _admit(c: Coordinator, lines: dict[str, FakeLine], *, prepared: bool = False) -> None:
    """A worker admitted on each line, as the door hands its hello over (then its
    trainer built, where ``prepared``)."""
    for i, (name, line) in enumerate(lines.items()):
        c.unadmitted[i] = _conn(i, line)
        c.sel.register(line.sock, 1, i)
        c.queue.append(pol.Joined(i, _hello(name), True, time.monotonic()))
        if prepared:
            c.queue.append(pol.Received(name, p.Heartbeat(next_step=0, prepared=True), 0.0))


def _conn(i: int, line: FakeLine) -> Any:
    from perdure.runtime.control.door import Conn

    return Conn(i, line, "nonce", time.monotonic())  # type: ignore[arg-type]


def test_garbage_before_admission_is_counted_and_disconnected(tmp_path: Path) -> None:
    c = _coordinator(tmp_path, 99)
    t = threading.Thread(target=c.serve, kwargs={"deadline_s": 20}, daemon=True)
    t.start()
    try:
        for payload in (b"this is not json\n", b"5\n", b'{"type": "hb"}\n', b"\xff\xfe\n"):
            with socket.create_connection(("127.0.0.1", c.channel_port), timeout=5) as s:
                s.recv(4096)  # the challenge
                s.sendall(payload)
                s.settimeout(5)
                reply = s.recv(4096)
                assert b"refused" in reply and b"protocol error" in reply
        with socket.create_connection(("127.0.0.1", c.channel_port), timeout=5) as s:
            s.recv(4096)
            s.sendall(b"x" * (p.MAX_LINE + 10))  # no newline: bounded, then refused
            s.settimeout(5)
            assert b"without a newline" in s.recv(4096)
        assert t.is_alive()
        refused = logged(tmp_path / "events.jsonl", ev.REFUSED)
        end = time.monotonic() + 10
        while sum(e["count"] for e in refused) < 5 and time.monotonic() < end:
            time.sleep(0.2)
            refused = logged(tmp_path / "events.jsonl", ev.REFUSED)
        # Five refusals, counted: a line per interval (about a second), not one each.
        assert sum(e["count"] for e in refused) == 5 and len(refused) <= 2
        reasons = [r for e in refused for r in e["reasons"]]
        assert all("protocol error" in r for r in reasons)
    finally:
        c.stop()
        t.join(10)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Coordinator]:
    c = _coordinator(tmp_path, 99)
    t = threading.Thread(target=c.serve, kwargs={"deadline_s": 60}, daemon=True)
    t.start()
    yield c
    c.stop()
    t.join(10)
    assert not t.is_alive()


def _admitted(c: Coordinator, name: str) -> socket.socket:
    line, _ = connect("127.0.0.1", c.channel_port, "t", _hello_for(name), 5.0)
    return line.sock


def _hello_for(name: str) -> Any:
    return lambda mac: p.Hello(**{**_hello(name).__dict__, "mac": mac})


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(payload=st.binary(min_size=1, max_size=300))
def test_the_coordinator_survives_any_bytes_before_and_after_admission(
    served: Coordinator, payload: bytes
) -> None:
    with socket.create_connection(("127.0.0.1", served.channel_port), timeout=5) as s:
        s.recv(4096)
        s.sendall(payload + b"\n")
    name = f"w{abs(hash(payload)) % 10**9}"
    s = _admitted(served, name)
    s.sendall(payload + b"\n")
    s.close()
    # still serving: a fresh worker is admitted
    _admitted(served, name + "x").close()


class ChattyLine(FakeLine):
    """A line whose every chunk of bytes is one heartbeat."""

    def feed(self, data: bytes) -> list[Any]:
        return [p.Heartbeat(next_step=0, prepared=True)]


def test_a_death_notice_closes_its_worker_after_what_it_sent_and_spares_a_newer_pid(
    tmp_path: Path,
) -> None:
    from perdure.runtime.control.coordinator import DIED

    c = _coordinator(tmp_path, 3)
    lines: dict[str, FakeLine] = {n: ChattyLine() for n in ("w0", "w1", "w2")}
    try:
        _admit(c, lines)
        c._drain()
        lines["w1"].peer.sendall(b"its last line\n")  # sent before it died
        c.alive._dead.extend([("w1", 1), ("w2", 999)])  # w2's is an older process's
        c.alive._poke.send(b"!")
        c._on_deaths()
        assert [(type(e).__name__, e.worker) for e in c.queue] == [
            ("Received", "w1"),
            ("Closed", "w1"),
        ]
        assert c.queue[-1].reason == DIED
        c._drain()
        assert not c.policy.workers["w1"].alive and "w1" not in c.lines
        assert c.policy.workers["w2"].alive and "w2" in c.lines
    finally:
        c._shutdown()
