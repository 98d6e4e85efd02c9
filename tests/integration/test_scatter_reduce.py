"""The exact reduction reduce-scattered inside replica groups (``comm/scatter.py``): each
rank's shard range and the buffer's tail hold the flat reduction's bits, for one group and
for several, with ranges that cut blocks, an empty range, both widths and both the fused
kernels and the torch ops."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from perdure.runtime.comm import exact
from perdure.runtime.comm.exact import ExactReducer
from perdure.runtime.comm.scatter import Scatter
from tests.gloo_support import run_ranks

S, N, P = 8, 5000, 4990  # 10 tail values after the gradient part, as a slot buffer has
T = timedelta(seconds=30)
# k = 2 in two groups (ranges cut blocks of 256); k = 4 in one group, with an empty range
# (k, ranges, bits, fused kernels, values per bucket: the default 1M is one bucket here,
# the first tier's collective)
CASES = [
    (2, ((0, 1000), (1000, P)), 64, True, 1 << 20, "reduce_scatter"),
    (2, ((0, 1000), (1000, P)), 32, False, 768, "all_reduce"),
    (4, ((0, 300), (300, 300), (300, 2571), (2571, P)), 64, False, 1 << 20, "all_reduce"),
    (4, ((0, 300), (300, 300), (300, 2571), (2571, P)), 32, True, 512, "reduce_scatter"),
    (2, ((0, 4900), (4900, P)), 64, True, 256, "reduce_scatter"),  # a bucket of the tail alone
    (2, ((0, 4900), (4900, P)), 32, False, 256, "all_reduce"),
]
SLOTS = [[0, 1], [2, 3, 4], [5], [6, 7]]  # by rank of the world of 4


def _slots() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [
        torch.randn(N, generator=g) * torch.exp(3 * torch.randn(N, generator=g)) for _ in range(S)
    ]


def _flat(bits: int) -> torch.Tensor:
    r = ExactReducer(0, 1, slots=S, bits=bits, block=256, fused=False)
    return r.reduce(None, _slots(), T).clone()


def _pg(store: dist.Store, name: str, rank: int, size: int) -> dist.ProcessGroup:
    return dist.ProcessGroupGloo(dist.PrefixStore(name, store), rank, size, T)


def _rank(rank: int, world: int, port: int, q: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, T)
    pg = _pg(store, "all/", rank, world)
    bufs = _slots()
    for i, (k, ranges, bits, fused, chunk, first) in enumerate(CASES):
        exact.CHUNK = chunk
        exact._bucket_ranges.cache_clear()
        g, j = rank // k, rank % k
        group = _pg(store, f"{i}/group{g}/", j, k)
        cross = _pg(store, f"{i}/cross{j}/", g, world // k) if world > k else None
        sc = Scatter(group, cross, ranges, j, P, N, first)
        r = ExactReducer(rank, world, slots=S, bits=bits, block=256, fused=fused, scatter=sc)
        out = r.reduce(pg, [bufs[s].clone() for s in SLOTS[rank]], T)
        q.put((i, rank, {span: out[span[0] : span[1]].clone() for span in sc.spans()}))


@pytest.mark.timeout(120)
def test_each_rank_gets_the_flat_reductions_bits_on_its_range_and_the_tail() -> None:
    got = run_ranks(_rank, 4, 4 * len(CASES))
    want = {bits: _flat(bits) for bits in (32, 64)}
    seen = {(i, r) for i, r, _ in got}
    assert seen == {(i, r) for i in range(len(CASES)) for r in range(4)}
    for i, rank, spans in got:
        k, ranges, bits, *_ = CASES[i]
        mine = ranges[rank % k]
        expected = ([mine] if mine[0] < mine[1] else []) + [(P, N)]
        assert sorted(spans) == sorted(expected), (i, rank)
        for (lo, hi), values in spans.items():
            assert torch.equal(values, want[bits][lo:hi]), (i, rank, lo, hi)


def test_a_scatter_whose_ranges_do_not_tile_the_gradient_part_is_a_bug() -> None:
    with pytest.raises(AssertionError):
        Scatter(None, None, ((0, 10), (11, P)), 0, P, N)


# -- the carried form ------------------------------------------------------------------------

CARRIED_SLOTS = [[0, 1, 2], [], [3, 4, 5, 6], [7]]  # by rank; one rank without a slot
CARRIED_P = 5 * 256 + 10  # then a tail of 7 values


class _Inline:
    """A comm whose thread is the caller's."""

    def __init__(self, pg: dist.ProcessGroup) -> None:
        self.pg = pg

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        f: Future[Any] = Future()
        f.set_result(fn())
        return f


def _carried_pass(
    red: Any, comm: _Inline, bufs: list[torch.Tensor], mine: list[int], used: Any
) -> Any:
    """One pass of a rank's slots, each added as it finishes, the last one in ``finish``."""
    buf = torch.empty_like(bufs[0])
    red.open(buf, used)
    for s in mine:
        buf.copy_(bufs[s])
        if s != mine[-1]:
            red.add(buf)
    return red.finish(comm, buf, timeout=T, last=buf if mine else None).result()


def _carried_rank(rank: int, world: int, port: int, q: mp.Queue) -> None:
    from perdure.runtime.comm.carried import CarriedReducer, predict
    from tests.integration.test_carried import _slots as carried_slots

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, T)
    comm = _Inline(_pg(store, "all/", rank, world))
    k, g, j = 2, rank // 2, rank % 2
    n = CARRIED_P + 7
    bufs = carried_slots(4, n)
    group, cross = _pg(store, f"group{g}/", j, k), _pg(store, f"cross{j}/", g, world // k)
    for first in ("reduce_scatter", "all_reduce"):
        sc = Scatter(group, cross, ((0, 700), (700, CARRIED_P)), j, CARRIED_P, n, first)
        red = CarriedReducer(rank, world, slots=S, block=256, scatter=sc)
        _, maxima = _carried_pass(red, comm, bufs, CARRIED_SLOTS[rank], None)
        out, again = _carried_pass(red, comm, bufs, CARRIED_SLOTS[rank], predict(maxima))
        spans = {span: out[span[0] : span[1]].clone() for span in sc.spans()}
        q.put((first, rank, maxima, again, spans))


@pytest.mark.timeout(120)
def test_the_carried_form_reduce_scattered_gives_the_flat_bits_and_every_rank_its_verdict() -> None:
    from perdure.runtime.comm.carried import CarriedReducer, predict
    from tests.integration.test_carried import _pass
    from tests.integration.test_carried import _slots as carried_slots

    got = run_ranks(_carried_rank, 4, 8)
    bufs = carried_slots(4, CARRIED_P + 7)
    red = CarriedReducer(0, 1, slots=S, block=256)
    _, maxima = _pass(red, bufs, None)
    want, _ = _pass(red, bufs, predict(maxima))
    assert sorted((first, rank) for first, rank, *_ in got) == sorted(
        (f, r) for f in ("all_reduce", "reduce_scatter") for r in range(4)
    )
    for first, rank, got_maxima, again, spans in got:
        assert got_maxima == maxima and again == maxima, (first, rank)
        mine = ((0, 700), (700, CARRIED_P))[rank % 2]
        assert sorted(spans) == [mine, (CARRIED_P, CARRIED_P + 7)]
        for (lo, hi), values in spans.items():
            assert torch.equal(values, want[lo:hi]), (first, rank, lo, hi)


STREAMED_P, STREAMED_SLOTS = 5 * 256 + 40, [[0, 1], [2], [3, 4, 5], [6, 7]]
"""A gradient part of five whole blocks and a partial one; two groups of k = 2 (ranks
0-1, 2-3), each rank with its own slots (rank 1 with one: its integers in place)."""


def _streamed_rank(rank: int, world: int, port: int, q: mp.Queue) -> None:
    from perdure.runtime.comm.readiness import Readiness
    from perdure.runtime.comm.streamed import StreamedReducer, predict, used
    from tests.integration.test_streamed import _low, _slots, _Threaded

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, T)
    comm = _Threaded()  # the comm thread: the backward hands the last slot over meanwhile
    comm.pg = _pg(store, "all/", rank, world)
    k, g, j, n = 2, rank // 2, rank % 2, STREAMED_P + 9
    bufs = _slots(3, n)
    group, cross = _pg(store, f"group{g}/", j, k), _pg(store, f"cross{j}/", g, world // k)
    mine = STREAMED_SLOTS[rank]
    for first in ("all_reduce", "reduce_scatter"):
        ranges = ((0, 3 * 256 + 100), (3 * 256 + 100, STREAMED_P))  # a cut inside a block
        sc = Scatter(group, cross, ranges, j, STREAMED_P, n, first)
        red = StreamedReducer(rank, world, slots=S, bits=32, block=256, scatter=sc)

        def one_pass(exps: Any, red: StreamedReducer = red) -> Any:
            buf = torch.empty(n)
            red.open(buf, exps, adds=len(mine) - 1)
            for s in mine[:-1]:
                buf.copy_(bufs[s])
                red.add(buf)
            ready = Readiness()
            fut = red.finish(comm, buf, timeout=T, last=buf, ready=ready)
            buf.copy_(bufs[mine[-1]])
            ready.advance(n)
            return fut.result(timeout=60)

        _, maxima = one_pass(None)
        for name, exps in (("low", used(_low(maxima))), ("predicted", used(predict(None, maxima)))):
            out, _ = one_pass(exps)
            q.put((first, name, rank, {s: out[s[0] : s[1]].clone() for s in sc.spans()}))


@pytest.mark.timeout(120)
def test_the_streamed_form_reduce_scattered_over_two_groups_gives_the_flat_bits_with_outliers() -> (
    None
):
    """A prediction that every other block outgrows sends those blocks through the outlier
    lane, whose main integers must be the ones summed over every group: they were once
    read before the cross-group sum had landed, so each group kept its own (a run with
    two groups diverged at its first predicted step)."""
    from perdure.runtime.comm.streamed import StreamedReducer, predict, used
    from tests.integration.test_streamed import _low, _pass, _slots

    got = run_ranks(_streamed_rank, 4, 16)
    n = STREAMED_P + 9
    bufs = _slots(3, n)
    red = StreamedReducer(0, 1, slots=S, bits=32, block=256)
    _, maxima = _pass(red, bufs, None)
    want = {
        "low": _pass(red, bufs, used(_low(maxima)))[0],
        "predicted": _pass(red, bufs, used(predict(None, maxima)))[0],
    }
    assert not torch.equal(want["low"], want["predicted"])  # the lane rounds otherwise
    assert len(got) == 16
    for first, name, rank, spans in got:
        for (lo, hi), values in spans.items():
            assert torch.equal(values, want[name][lo:hi]), (first, name, rank, lo, hi)
