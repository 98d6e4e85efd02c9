"""Admission to a run: the token proves membership without ever crossing the wire."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from perdure.run_config import RunConfig
from perdure.runtime.control import protocol as p
from perdure.runtime.control.channel import UNACKED_S, AdmissionRefused, connect, mac, verify
from perdure.runtime.control.coordinator import Coordinator
from tests.runtime_support import logged

TOKEN = "s3cret-run-token"


@pytest.fixture
def coordinator(tmp_path: Path) -> Iterator[Coordinator]:
    c = Coordinator(RunConfig(), run_dir=str(tmp_path), token=TOKEN, expected_workers=99)
    thread = threading.Thread(target=c.serve, kwargs={"deadline_s": 30}, daemon=True)
    thread.start()
    yield c
    c.finished = True
    thread.join(10)


def _hello(name: str) -> Callable[[str], p.Hello]:
    def hello(mac: str) -> p.Hello:
        return p.Hello(
            name=name,
            region="local",
            role="worker",
            pid=1,
            next_step=0,
            has_state=False,
            epoch=-1,
            mac=mac,
        )

    return hello


def test_worker_with_the_run_token_is_admitted_and_gets_the_config(
    coordinator: Coordinator,
) -> None:
    line, welcome = connect("127.0.0.1", coordinator.channel_port, TOKEN, _hello("local-0"), 5.0)
    assert isinstance(welcome, p.Welcome)
    assert welcome.store_port == coordinator.store_port
    assert welcome.config["train"]["slots"] == RunConfig().train.slots
    line.close()


@pytest.mark.skipif(
    not hasattr(socket, "TCP_USER_TIMEOUT"), reason="needs Linux's TCP_USER_TIMEOUT"
)
def test_a_channel_whose_bytes_go_unacknowledged_for_15_s_counts_as_lost(
    coordinator: Coordinator,
) -> None:
    """A blackholed path breaks the channel after UNACKED_S, not TCP's ~15 minutes."""
    line, _ = connect("127.0.0.1", coordinator.channel_port, TOKEN, _hello("local-0"), 5.0)
    ms = line.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
    line.close()
    assert ms == UNACKED_S * 1000 == 15000


def test_unauthorised_worker_is_refused_and_counted(
    coordinator: Coordinator, tmp_path: Path
) -> None:
    with pytest.raises(AdmissionRefused, match="bad run token"):
        connect("127.0.0.1", coordinator.channel_port, "wrong", _hello("intruder"), 5.0)
    refused = logged(tmp_path / "events.jsonl", "refused")
    # A stranger's claimed name is not trusted: counted under its reason, by door.
    assert refused == [
        {**refused[0], "worker": None, "door": "channel", "count": 1, "reason": "bad run token"}
    ]
    assert refused[0]["reasons"] == {"bad run token": 1}
    assert "intruder" not in coordinator.workers


def test_a_second_worker_is_told_to_retry_while_the_name_holder_heartbeats(
    coordinator: Coordinator,
) -> None:
    line, _ = connect("127.0.0.1", coordinator.channel_port, TOKEN, _hello("local-0"), 5.0)
    line.send(p.Heartbeat(next_step=0, prepared=False))
    with pytest.raises(AdmissionRefused, match="in use by pid 1, which heartbeats") as e:
        connect("127.0.0.1", coordinator.channel_port, TOKEN, _hello("local-0"), 5.0)
    assert e.value.retry
    line.close()


def test_the_answer_depends_on_the_nonce_so_a_replayed_answer_fails() -> None:
    assert verify(TOKEN, "nonce-a", mac(TOKEN, "nonce-a"))
    assert not verify(TOKEN, "nonce-b", mac(TOKEN, "nonce-a"))


def test_a_silent_squatter_on_a_name_gives_it_up_to_the_real_worker(
    coordinator: Coordinator,
) -> None:
    from perdure.runtime.control.client import Identity, MembershipClient

    squatter, _ = connect("127.0.0.1", coordinator.channel_port, TOKEN, _hello("local-0"), 5.0)
    real = MembershipClient(
        Identity("local-0", "local", "worker"),
        [("127.0.0.1", coordinator.channel_port)],
        TOKEN,
        timeout_s=20.0,
        progress=lambda: (0, False),
    )
    welcome = real.connect()  # told to retry while the squatter is fresh, then admitted
    assert isinstance(welcome, p.Welcome)
    assert coordinator.workers["local-0"].pid == os.getpid()
    squatter.close()
    real.line.close()  # type: ignore[union-attr]
