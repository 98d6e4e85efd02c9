"""The deterministic reduction: a pipelined chain that adds slot gradients in slot order.

Ranks are ordered by their slot ranges (rank 0 holds the first slots). The flat buffer is
cut into chunks (4 MiB); for each chunk, rank 0 folds its own slots left to right and sends the
running sum to rank 1, which adds its own slots one by one and passes it on, and so on to
the last rank. The result is exactly the left fold ``((g0 + g1) + g2) + ...`` over all slots
whatever the assignment, because every addition happens in slot order on whichever rank
holds the slot. The last rank then streams the finished chunks back down the chain.

Each link carries about 2P bytes, like a ring allreduce; chunks pipeline the hops, so the
latency is (hops + chunks) chunk-times rather than hops x P. Limit: ranks after the first
keep each of their slot gradients until the running sum arrives (memory: slots x P).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch

CHUNK_ELEMS = 1 << 20  # 4 MiB of float32: best on loopback in benchmarks/bench_reduce.py


def chunk_ranges(n: int, chunk: int = CHUNK_ELEMS) -> list[tuple[int, int]]:
    return [(lo, min(n, lo + chunk)) for lo in range(0, n, chunk)] or [(0, 0)]


def fold_into(acc: torch.Tensor, bufs: Sequence[torch.Tensor], lo: int, hi: int) -> None:
    """``acc += bufs[0][lo:hi]; acc += bufs[1][lo:hi]; ...`` in order."""
    for b in bufs:
        acc.add_(b[lo:hi])


def local_fold(bufs: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """The fold of one rank's slots alone (rank 0's contribution, or a 1-member epoch)."""
    out.copy_(bufs[0])
    fold_into(out, bufs[1:], 0, out.numel())


def chain_reduce(
    pg: Any,
    rank: int,
    size: int,
    bufs: Sequence[torch.Tensor],
    partial: torch.Tensor,
    out: torch.Tensor,
    *,
    timeout: timedelta,
    chunk: int = CHUNK_ELEMS,
    send_delay_s: float = 0.0,
    wait_last: Callable[[int], None] | None = None,
) -> None:
    """Reduce the slot buffers of all ranks into ``out`` on every rank (see module doc).

    ``bufs`` are this rank's slot gradients in slot order; ``partial`` is scratch space of
    the same size. ``send_delay_s`` injects link latency before this rank's first send (the
    ``delay`` fault). ``wait_last(hi)`` blocks until ``bufs[-1][:hi]`` is final: the last
    slot's backward may still be running, and the chain streams behind it.
    """
    wait = wait_last or (lambda hi: None)
    assert bufs, "every member of a membership epoch holds at least one slot"
    if size == 1:
        wait(out.numel())
        local_fold(bufs, out)
        return
    chunks = chunk_ranges(out.numel(), chunk)
    n = len(chunks)
    last = rank == size - 1
    fwd = partial if not last else out
    recv_fwd = (
        [pg.recv([fwd[lo:hi]], rank - 1, c) for c, (lo, hi) in enumerate(chunks)] if rank else []
    )
    recv_bwd = (
        [pg.recv([out[lo:hi]], rank + 1, n + c) for c, (lo, hi) in enumerate(chunks)]
        if not last
        else []
    )
    sends: list[Any] = []
    lag = 2 * (size - 1 - rank)
    delayed = send_delay_s <= 0
    for c, (lo, hi) in enumerate(chunks):
        acc = fwd[lo:hi]
        wait(hi)
        if rank == 0 and len(bufs) == 1:
            acc = bufs[0][lo:hi]  # nothing to fold: send the slot itself, not a copy of it
        elif rank == 0:
            acc.copy_(bufs[0][lo:hi])
            fold_into(acc, bufs[1:], lo, hi)
        else:
            recv_fwd[c].wait(timeout)
            fold_into(acc, bufs, lo, hi)
        if not delayed:
            time.sleep(send_delay_s)
            delayed = True
        peer = rank - 1 if last else rank + 1
        sends.append(pg.send([acc], peer, n + c if last else c))
        if not last and c >= lag:
            _pass_back(pg, rank, out, chunks, c - lag, recv_bwd, sends, n, timeout)
    if not last:
        for c in range(max(0, n - lag), n):
            _pass_back(pg, rank, out, chunks, c, recv_bwd, sends, n, timeout)
    for s in sends:
        s.wait(timeout)


def _pass_back(
    pg: Any,
    rank: int,
    out: torch.Tensor,
    chunks: list[tuple[int, int]],
    c: int,
    recv_bwd: list[Any],
    sends: list[Any],
    n: int,
    timeout: timedelta,
) -> None:
    recv_bwd[c].wait(timeout)
    if rank > 0:
        lo, hi = chunks[c]
        sends.append(pg.send([out[lo:hi]], rank - 1, n + c))


class ChainReducer:
    """The chain as a :class:`~perdure.runtime.comm.reducer.Reducer`: one member's side of
    it, with its scratch buffers (a running sum and the result, per buffer size)."""

    carried = False
    scatters = False
    """One buffer per slot, summed by :meth:`start` (no carried state)."""

    def __init__(self, rank: int, size: int, chunk: int = CHUNK_ELEMS) -> None:
        self.rank, self.size, self.chunk = rank, size, chunk
        self.scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _buffers(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = like.numel()
        if n not in self.scratch:
            self.scratch[n] = (torch.empty_like(like), torch.empty_like(like))
        return self.scratch[n]

    def start(
        self,
        comm: Any,
        bufs: Sequence[torch.Tensor],
        *,
        timeout: timedelta,
        ready: Any = None,
        abort: Callable[[], bool] = lambda: False,
        send_delay_s: float = 0.0,
    ) -> Future[torch.Tensor]:
        partial, out = self._buffers(bufs[0])
        t = timeout.total_seconds()
        wait = None if ready is None else (lambda hi: ready.wait(hi, abort, t))

        def run() -> torch.Tensor:
            chain_reduce(
                comm.pg,
                self.rank,
                self.size,
                bufs,
                partial,
                out,
                timeout=timeout,
                chunk=self.chunk,
                send_delay_s=send_delay_s,
                wait_last=wait,
            )
            return out

        return comm.submit(run)
