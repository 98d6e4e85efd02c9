"""The run's store answers only to the run token, and carries a process group like TCPStore."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import socket
import struct
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from perdure.runtime.control.auth_store import AuthStore
from perdure.runtime.control.store import StoreServer

TOKEN = "run-token"


@pytest.fixture
def server() -> Iterator[StoreServer]:
    s = StoreServer("127.0.0.1", 0, TOKEN)
    yield s
    s.close()


def _client(server: StoreServer, token: str = TOKEN) -> AuthStore:
    return AuthStore("127.0.0.1", server.port, token, timedelta(seconds=5))


def test_every_operation_round_trips(server: StoreServer) -> None:
    s = _client(server)
    s.set("a", "x")
    s.set("b", b"\x00\xff")
    assert (s.get("a"), s.get("b")) == (b"x", b"\x00\xff")
    assert s.add("n", 3) == 3 and s.add("n", -1) == 2
    assert s.check(["a", "b"]) and not s.check(["a", "zz"])
    assert s.compare_set("a", b"x", b"y") == b"y" and s.get("a") == b"y"
    assert s.delete_key("a") and not s.check(["a"])
    assert s.num_keys() == 2
    with pytest.raises(dist.DistStoreError, match="timeout"):
        s.wait(["never"], timedelta(milliseconds=100))
    s.set_timeout(timedelta(milliseconds=100))
    with pytest.raises(dist.DistStoreError):
        s.get("missing")  # a missing key waits for the store's timeout, then fails


def test_a_client_without_the_token_can_neither_read_nor_write(server: StoreServer) -> None:
    _client(server).set("rendezvous", "secret")
    with pytest.raises(dist.DistNetworkError, match="bad run token"):
        _client(server, token="guess")
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        raw.recv(4096)  # the challenge; answer it with an operation instead
        body = b'{"op": "set", "keys": ["rendezvous"], "sizes": [1]}\nX'
        raw.sendall(struct.pack(">I", len(body)) + body)
        reply = raw.recv(4096)
        assert b"bad run token" in reply
    assert _client(server).get("rendezvous") == b"secret"


def test_a_tcpstore_client_gets_nothing(server: StoreServer) -> None:
    with pytest.raises((RuntimeError, dist.DistError)):
        dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    assert _client(server).num_keys() == 0


def test_broken_frames_disconnect_that_client_only(server: StoreServer) -> None:
    good = _client(server)
    for junk in (b"\xff\xff\xff\xff", struct.pack(">I", 5) + b"nojsn", b"\x00"):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            raw.recv(4096)
            raw.sendall(junk)
    good.set("still", "here")
    assert _client(server).get("still") == b"here"


def _member(rank: int, port: int, world: int, out: mp.Queue) -> None:
    store = AuthStore("127.0.0.1", port, TOKEN, timedelta(seconds=20))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("pg/0/", store), rank, world, timedelta(seconds=20))
    t = torch.full((4,), float(rank + 1))
    pg.allreduce([t]).wait()
    out.put((rank, t.tolist()))


def test_a_gloo_group_forms_through_it(server: StoreServer) -> None:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=_member, args=(r, server.port, 3, out)) for r in range(3)]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(30)
    assert results == {r: [6.0] * 4 for r in range(3)}


def test_a_64_mib_frame_before_the_token_is_refused_after_a_few_bytes(
    server: StoreServer,
) -> None:
    from perdure.runtime.control import store as st

    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        raw.recv(4096)
        body = struct.pack(">I", 64 << 20) + b"\0" * (64 << 20)
        with contextlib.suppress(OSError):  # the server closes it mid-send: the point
            raw.sendall(body)
    assert server.unauthenticated_bytes <= st.AUTH_BYTES <= 4096
    assert server.refusals.total == 1
    assert _client(server).num_keys() == 0


def test_a_dribbling_connection_is_closed_at_the_admission_deadline(
    server: StoreServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from perdure.runtime.control import store as st

    monkeypatch.setattr(st, "ADMISSION_S", 1.0)
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
        raw.recv(4096)
        end = time.monotonic() + 10
        closed, answer = False, st.AUTH_MAGIC + b"0" * 64
        while time.monotonic() < end and not closed:
            try:
                raw.sendall(answer[:1])  # a valid prefix, one byte at a time
                answer = answer[1:]
                raw.settimeout(0.3)
                closed = b"no answer within" in raw.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                closed = True
    assert closed and time.monotonic() < end
    assert server.refusals.take(time.monotonic(), final=True)["reason"].startswith("no answer")


def test_a_flood_of_unauthenticated_connections_does_not_keep_a_client_out(
    server: StoreServer,
) -> None:
    from perdure.runtime.control import store as st

    flood = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(300)]
    try:
        time.sleep(0.3)
        assert server.pending <= st.MAX_PENDING
        s = _client(server)
        s.set("k", "v")
        assert s.get("k") == b"v"
    finally:
        for f in flood:
            f.close()
    record = server.refusals.take(time.monotonic(), final=True)
    assert record is not None and record["reasons"]["too many unauthenticated connections"] > 0
