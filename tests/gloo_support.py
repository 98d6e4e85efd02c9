"""Spawned processes that form one gloo group on loopback: what the multi-rank tests of the
reductions and the replica groups share."""

from __future__ import annotations

import multiprocessing as mp
import socket
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(
    target: Callable[..., None], world: int, results: int, timeout_s: float = 60
) -> list[Any]:
    """Start ``target(rank, world, port, queue)`` in ``world`` spawned processes (rank 0's
    TCPStore on ``port``) and return the first ``results`` items they put on the queue;
    every process is joined, or killed when it outlives the wait."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, world, port, q)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return [q.get(timeout=timeout_s) for _ in range(results)]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
