"""The run's store answers only to the run token, and carries a process group like TCPStore."""

from __future__ import annotations

import multiprocessing as mp
import socket
import struct
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from perdure.runtime.control.store import AuthStore, StoreServer

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
