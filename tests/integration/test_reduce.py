from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from perdure.runtime.comm.chain import chain_reduce, local_fold

N, SLOTS = 5003, 6


def _slot(s: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + s)
    return torch.randn(N, generator=g) * (10.0 ** (s % 4 - 2))  # mixed magnitudes: order matters


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member(rank: int, ranges: list[tuple[int, int]], port: int, out_dir: str) -> None:
    size = len(ranges)
    store = dist.TCPStore("127.0.0.1", port, size, rank == 0, timeout=timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("t", store), rank, size, timedelta(seconds=30))
    bufs = [_slot(s) for s in range(*ranges[rank])]
    partial, out = torch.empty(N), torch.empty(N)
    chain_reduce(pg, rank, size, bufs, partial, out, timeout=timedelta(seconds=30), chunk=1000)
    Path(out_dir, f"{rank}.bin").write_bytes(out.numpy().tobytes())


def _run(ranges: list[tuple[int, int]], tmp: Path) -> list[bytes]:
    ctx = mp.get_context("spawn")
    port = _free_port()
    procs = [
        ctx.Process(target=_member, args=(r, ranges, port, str(tmp))) for r in range(len(ranges))
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(50)
        assert p.exitcode == 0
    return [(tmp / f"{r}.bin").read_bytes() for r in range(len(ranges))]


def test_chain_reduction_equals_the_slot_ordered_fold_whatever_the_assignment(
    tmp_path: Path,
) -> None:
    expected = torch.empty(N)
    local_fold([_slot(s) for s in range(SLOTS)], expected)
    want = expected.numpy().tobytes()
    for i, ranges in enumerate(
        [[(0, 2), (2, 4), (4, 6)], [(0, 1), (1, 5), (5, 6)], [(0, 5), (5, 6)]]
    ):
        d = tmp_path / str(i)
        d.mkdir()
        assert _run(ranges, d) == [want] * len(ranges)


def test_a_different_order_gives_different_bits() -> None:
    """The check above can fail: floating-point addition is not associative here."""
    fwd, rev = torch.empty(N), torch.empty(N)
    local_fold([_slot(s) for s in range(SLOTS)], fwd)
    local_fold([_slot(s) for s in reversed(range(SLOTS))], rev)
    assert not torch.equal(fwd, rev)
