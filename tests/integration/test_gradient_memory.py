"""A rank's gradient side in replica groups: the pages of other shards' values handed back
once their bucket is exchanged (``comm/pages.py``), the backward held to a window of
buckets ahead of the reduction (``comm/readiness.py``), and the bits unchanged."""

from __future__ import annotations

import multiprocessing as mp
import sys
import threading
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from perdure.runtime.comm import exact
from perdure.runtime.comm.pages import PAGE, release
from perdure.runtime.comm.readiness import Readiness
from perdure.runtime.comm.scatter import Scatter
from perdure.runtime.comm.streamed import StreamedReducer, fitted
from tests.gloo_support import run_ranks

T = timedelta(seconds=30)
linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE / 2**20


# -- pages ---------------------------------------------------------------------------------


@linux
def test_released_pages_leave_the_resident_set_and_read_as_zeros_after() -> None:
    x = torch.ones(64 * 2**20 // 4)
    before = _resident_mb()
    edge = PAGE // 4 + 7  # a range that starts and ends inside pages
    part = x[edge:-edge]
    start, end = part.data_ptr(), part.data_ptr() + part.numel() * 4
    lo, hi = -(-start // PAGE) * PAGE, end // PAGE * PAGE  # the whole pages inside
    assert release(part) == hi - lo
    assert before - _resident_mb() > 60
    first, last = (lo - x.data_ptr()) // 4, (hi - x.data_ptr()) // 4
    assert x[:first].eq(1).all() and x[last:].eq(1).all()  # partial pages keep their values
    assert x[first:last].eq(0).all()
    x[first : first + 1000] = 2.0  # written again: fresh pages, the values written
    assert x[first : first + 1000].eq(2).all()


def test_nothing_is_released_from_a_view_that_is_not_contiguous_or_too_small() -> None:
    x = torch.ones(4 * PAGE)
    assert release(x[::2]) == 0 and release(x[3:100]) == 0
    assert x.eq(1).all()


# -- the window ----------------------------------------------------------------------------


def _blocked(ready: Readiness, upto: int) -> threading.Thread:
    t = threading.Thread(target=ready.room, args=(upto,), daemon=True)
    t.start()
    time.sleep(0.1)
    return t


def test_the_backward_waits_for_room_and_goes_on_once_allowed() -> None:
    ready = Readiness()
    ready.room(10**9)  # no window: never held
    ready.allow(100)
    ready.room(100)
    t = _blocked(ready, 101)
    assert t.is_alive()
    ready.allow(200)
    t.join(2)
    assert not t.is_alive()


def test_the_window_never_holds_the_backward_while_the_reduction_waits_for_it() -> None:
    """A gradient that comes out of order (past the window, before the prefix the
    reduction waits for) must be written, or neither side moves."""
    ready = Readiness()
    ready.allow(100)
    t = _blocked(ready, 500)
    assert t.is_alive()
    waiter = threading.Thread(target=ready.wait, args=(50, lambda: False, 5.0), daemon=True)
    waiter.start()
    t.join(2)
    assert not t.is_alive()  # the reduction is starved: the backward goes on
    ready.advance(50)
    waiter.join(2)
    assert not waiter.is_alive()


@pytest.mark.parametrize("how", ["close", "abort"])
def test_a_closed_reduction_or_an_abandoned_step_releases_the_backward(how: str) -> None:
    stop = threading.Event()
    ready = Readiness(abort=stop.is_set)
    ready.allow(0)
    t = _blocked(ready, 1)
    assert t.is_alive()
    ready.close() if how == "close" else stop.set()
    t.join(2)
    assert not t.is_alive()


# -- one slot a member, reduce-scattered in two groups of two ------------------------------

BLOCK, N, P = 256, 40 * 1024 + 10, 40 * 1024  # 10 tail values, as a slot buffer has
RANGES = ((0, 12_345), (12_345, P))  # a range boundary inside a block
CHUNK = 4096  # ten buckets


def _slot(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(11 + rank)
    return torch.randn(N, generator=g) * torch.exp(2 * torch.randn(N, generator=g))


class _Recorded(Readiness):
    """Notes, for each write the backward makes, whether the window allowed it or the
    reduction was starved (closed) at the time."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[int, float, bool]] = []

    def room(self, upto: int) -> None:
        super().room(upto)
        with self._cond:
            self.writes.append((upto, self._limit, self._starved or self._closed))


class _Comm:
    def __init__(self, pg: Any) -> None:
        self.pg = pg

    def submit(self, fn: Any) -> Any:
        from concurrent.futures import Future

        f: Future[Any] = Future()

        def run() -> None:
            try:
                f.set_result(fn())
            except BaseException as e:
                f.set_exception(e)

        threading.Thread(target=run, daemon=True).start()
        return f


def _member(rank: int, world: int, port: int, q: mp.Queue) -> None:
    exact.CHUNK = CHUNK
    exact._bucket_ranges.cache_clear()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, T)

    def pg(name: str, r: int, size: int) -> Any:
        return dist.ProcessGroupGloo(dist.PrefixStore(name, store), r, size, T)

    comm = _Comm(pg("all/", rank, world))
    g, j = rank // 2, rank % 2
    sc = Scatter(pg(f"g{g}/", j, 2), pg(f"c{j}/", g, 2), RANGES, j, P, N, "all_reduce")
    red = StreamedReducer(rank, world, slots=world, bits=32, block=BLOCK, scatter=sc)
    slot = _slot(rank)
    buf = torch.empty(N)
    red.open(buf, None, adds=0)  # the measuring pass: the step's maxima
    buf.copy_(slot)
    _, maxima = red.finish(comm, buf, timeout=T, last=buf).result(60)
    out = []
    for window in (True, False):
        red.open(buf, fitted(maxima), adds=0 if window else 1)
        ready = _Recorded()
        buf.fill_(float("nan"))  # what the backward has not written must never be read
        fut = red.finish(comm, buf, timeout=T, last=buf, ready=ready)
        for lo in range(0, P, 1000):  # the "backward": a parameter of 1000 values at a time
            hi = min(P, lo + 1000)
            ready.room(hi)
            buf[lo:hi] = slot[lo:hi]
            ready.advance(hi)
        buf[P:] = slot[P:]
        ready.advance(N)
        got, _ = fut.result(60)
        spans = {s: got[s[0] : s[1]].clone() for s in sc.spans()}
        out.append((red.aliased, spans, ready.writes))
    q.put((rank, out))


@pytest.mark.timeout(120)
def test_a_one_slot_member_holds_its_shard_and_two_buckets_with_the_flat_sums_bits() -> None:
    got = dict(run_ranks(_member, 4, 4))
    for rank, ((aliased, spans, writes), (apart, whole, _)) in got.items():
        assert aliased and not apart
        assert spans.keys() == whole.keys()
        for s in spans:  # in place and windowed: the separate accumulator's bits
            assert torch.equal(spans[s], whole[s]), (rank, s)
        # every write fit the window (at most two buckets past the last one settled)
        # or came while the reduction waited for it
        assert writes and all(hi <= limit or starved for hi, limit, starved in writes)
        assert any(limit < P for _, limit, _ in writes)  # the window did hold
