"""Spawned processes that form one gloo group on loopback: what the multi-rank tests of the
reductions and the replica groups share."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
from collections.abc import Callable
from typing import Any


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank(target: Callable[..., None], done: Any, *args: Any) -> None:
    """Run ``target``, then stay alive until the parent has read every result: a tensor put
    on the queue travels as a descriptor that its sender serves, so a sender that exits
    first leaves the parent a dead socket (seen under load: FileNotFoundError in get)."""
    target(*args)
    done.wait(120)


def run_ranks(
    target: Callable[..., None], world: int, results: int, timeout_s: float = 60
) -> list[Any]:
    """Start ``target(rank, world, port, queue)`` in ``world`` spawned processes (rank 0's
    TCPStore on ``port``) and return the first ``results`` items they put on the queue;
    every process is joined, or killed when it outlives the wait."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q: mp.Queue = ctx.Queue()
    done = ctx.Event()
    procs = [
        ctx.Process(target=_rank, args=(target, done, r, world, port, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    try:
        return [q.get(timeout=timeout_s) for _ in range(results)]
    finally:
        done.set()
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()


def run_threads(target: Callable[[int], Any], world: int, timeout_s: float = 60) -> list[Any]:
    """``target(rank)`` for each rank in a thread of this process (in-process groups over
    a ``HashStore``: no process started); the results by rank. The first error of any
    rank is raised here."""
    out: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank_main(r: int) -> None:
        try:
            out[r] = target(r)
        except BaseException as e:  # re-raised by the caller's thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    if errors:
        raise errors[0]
    assert not any(t.is_alive() for t in threads), f"a rank outlived {timeout_s} s"
    return out
