"""Several slots a rank in replica groups (``train.shard_reduce_slots``): each slot
reduce-scattered in a round of its own (``each``) against the rank's slots added locally
and reduced once (``once``). Integer sums are associative, so both are the same bits; what
``each`` buys is the gradient side (P/k, not P)."""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from perdure import events as ev
from perdure.runtime.comm import exact
from perdure.runtime.comm.readiness import Readiness
from perdure.runtime.comm.scatter import Scatter
from perdure.runtime.comm.streamed import StreamedReducer, predict, used
from tests.gloo_support import run_ranks
from tests.runtime_support import events, run_to_end, small_config

T = timedelta(seconds=30)
BLOCK, S = 256, 10
P = 5 * 256 + 40  # five whole blocks and a partial one
N = P + 9  # the tail (buffer moves, flags, losses), reduced whole
SLOTS = [[0, 1, 2, 3, 4], [5, 6, 7], [8], [9]]
"""Two groups of k = 2 (ranks 0-1, 2-3): group 0 runs five rounds (rank 1 owes two of
zeros); group 1, one slot a rank, reduces once (the exchange across groups must match)."""
RANGES = ((0, 3 * 256 + 100), (3 * 256 + 100, P))  # a cut inside a block
CHUNK = 300  # the "backward" writes a parameter of 300 values at a time


def _slots() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [
        torch.randn(N, generator=g) * torch.exp(2 * torch.randn(N, generator=g)) for _ in range(S)
    ]


def _low(maxima: torch.Tensor) -> torch.Tensor:
    from tests.integration.test_streamed import _low as low

    return low(maxima)


def _backward(buf: torch.Tensor, src: torch.Tensor, ready: Readiness | None) -> None:
    """Write ``src`` into ``buf`` as a backward does: a parameter at a time, asking the
    window for room, the tail last."""
    if ready is None:
        buf.copy_(src)
        return
    for lo in range(0, P, CHUNK):
        hi = min(P, lo + CHUNK)
        ready.room(hi)
        buf[lo:hi] = src[lo:hi]
        ready.advance(hi)
    ready.room(N)
    buf[P:] = src[P:]
    ready.advance(N)


def _step_pass(
    red: StreamedReducer,
    comm: Any,
    mine: list[int],
    slots: list[torch.Tensor],
    exps: Any,
    rounds: int,
    stream: bool,
) -> Any:
    """The step runner's pass (``StepRunner._stream``): every slot but the last through
    ``begin_slot``/``add``, the last behind ``finish``; ``stream`` False: as sharded at
    rest (each slot whole, the padding passes ``skip``-ped before the last slot)."""
    buf = torch.empty(N)
    red.open(buf, exps, adds=max(0, len(mine) - 1), rounds=rounds)
    for s in mine[:-1]:
        ready = red.begin_slot(comm, timeout=T, abort=lambda: False, stream=stream)
        _backward(buf, slots[s], ready)
        red.add(buf)
    if not stream:
        for _ in range(rounds - len(mine)):
            red.skip(comm, timeout=T, abort=lambda: False)
        _backward(buf, slots[mine[-1]], None)
    ready = Readiness() if stream else None
    fut = red.finish(comm, buf, timeout=T, last=buf, ready=ready)
    if stream:
        _backward(buf, slots[mine[-1]], ready)
    return fut.result(timeout=60)


class _CommThread:
    """A comm with one thread of its own, as ``Comm``'s: its calls run in order."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg
        self.pool = ThreadPoolExecutor(1)

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        return self.pool.submit(fn)

    def result(self, fut: Future[Any]) -> Any:
        return fut.result(timeout=60)


def _rank(rank: int, world: int, port: int, q: mp.Queue) -> None:
    exact.CHUNK = 512  # two blocks a bucket: several buckets, each exchanged across groups
    exact._bucket_ranges.cache_clear()
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, T)

    def pg(name: str, r: int, size: int) -> Any:
        return dist.ProcessGroupGloo(dist.PrefixStore(name, store), r, size, T)

    comm = _CommThread(pg("all/", rank, world))
    k, g, j = 2, rank // 2, rank % 2
    group, cross = pg(f"group{g}/", j, k), pg(f"cross{j}/", g, world // k)
    slots, mine = _slots(), SLOTS[rank]
    rounds = max(len(SLOTS[r]) for r in range(world) if r // k == g)
    for first in ("all_reduce", "reduce_scatter"):
        sc = Scatter(group, cross, RANGES, j, P, N, first)
        for how in ("once", "each"):
            for stream in (True, False):
                red = StreamedReducer(
                    rank, world, slots=S, bits=32, block=BLOCK, scatter=sc, each=how == "each"
                )
                _, maxima = _step_pass(red, comm, mine, slots, None, rounds, stream)
                for name, exps in (
                    ("low", used(_low(maxima))),
                    ("predicted", used(predict(None, maxima))),
                ):
                    out, _ = _step_pass(red, comm, mine, slots, exps, rounds, stream)
                    spans = {s: out[s[0] : s[1]].clone() for s in sc.spans()}
                    q.put((first, how, stream, name, rank, spans, red.held_peak))


@pytest.mark.timeout(180)
def test_each_slot_reduce_scattered_gives_the_bits_of_one_reduction_with_less_held() -> None:
    """Ranks with 1 to 3 slots in two groups of two, both forms of the group's exchange,
    streamed behind the backward and not (as sharded at rest), a prediction with outlier
    blocks and one without: every rank's range and tail equal the one-member reduction
    of all the slots; ``each`` holds the rank's range (P/k integers) where ``once``
    holds P."""
    got = run_ranks(_rank, 4, 2 * 2 * 2 * 2 * 4, timeout_s=150)
    slots = _slots()
    solo = StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK)
    from tests.integration.test_streamed import _pass

    _, maxima = _pass(solo, slots, None)
    want = {
        "low": _pass(solo, slots, used(_low(maxima)))[0],
        "predicted": _pass(solo, slots, used(predict(None, maxima)))[0],
    }
    assert not torch.equal(want["low"], want["predicted"])  # the lane rounds otherwise
    held: dict[tuple[str, int], set[int]] = {}
    for first, how, stream, name, rank, spans, peak in got:
        assert spans, (first, rank)
        for (lo, hi), values in spans.items():
            assert torch.equal(values, want[name][lo:hi]), (first, how, stream, name, rank, lo, hi)
        held.setdefault((how, rank), set()).add(peak)
    for rank in range(4):
        lo, hi = RANGES[rank % 2]
        ranged = (hi - lo + N - P) * 4  # the rank's range and the tail, int32
        once = P * 4 + (N - P) * 4 if len(SLOTS[rank]) > 1 else 0  # aliased with one slot
        rounds = rank < 2  # group 1 has one round: reduced once, in place
        assert held[("each", rank)] == {ranged if rounds else 0}, rank
        assert held[("once", rank)] == {once}, rank


# -- in runs ---------------------------------------------------------------------------------

STEPS = 12


def _run(
    dataset: Path, run_dir: Path, workers: int, how: str, steps: int = STEPS, **kw: Any
) -> dict[str, Any]:
    at_rest = kw.pop("at_rest", False)
    train = {"shard_degree": 2, "shard_reduce_slots": how, "shard_params": at_rest}
    cfg = small_config(dataset, workers=workers, steps=steps, slots=5, batch=20, train=train, **kw)
    return run_to_end(cfg, run_dir)


@pytest.fixture(scope="module")
def once(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The default: two ranks of one group, three slots and two, each reduced once."""
    s = _run(small_dataset, tmp_path_factory.mktemp("once") / "run", 2, "once")
    return str(s["final_hash"])


@pytest.mark.parametrize(
    "workers,at_rest", [(2, False), (2, True), (4, False)], ids=["w2", "w2_at_rest", "w4"]
)
def test_each_slot_reduce_scattered_ends_with_the_bits_of_reducing_once(
    once: str, small_dataset: Path, tmp_path: Path, workers: int, at_rest: bool
) -> None:
    """5 slots a step over 2 ranks (3 and 2: the second owes its group a round of zeros)
    or 4 ranks in two groups; sharded at rest too (no slot streams, the padding pass is
    a round)."""
    run_dir = tmp_path / "run"
    s = _run(small_dataset, run_dir, workers, "each", at_rest=at_rest)
    assert s["final_hash"] == once
    assert s["replica_hashes_agree"]
    first = events(run_dir, ev.EPOCH_STARTED)[0]["epoch"]
    modes = {e["mode"] for e in events(run_dir, ev.SHARD_REDUCE) if e["epoch"] == first}
    assert modes == {"scatter"}


def test_a_killed_rank_under_each_changes_no_bit(
    once: str, small_dataset: Path, tmp_path: Path
) -> None:
    """r0-0 killed mid-run in two groups of two: the survivors' group goes on, rounds
    and all, to the bits of the run without the kill."""
    kill = [{"kind": "kill", "target": "r0-0", "at_step": STEPS // 3}]
    run_dir = tmp_path / "run"
    s = _run(small_dataset, run_dir, 4, "each", chaos={"faults": kill})
    assert s["final_hash"] == once
    assert [e["worker"] for e in events(run_dir, ev.LEAVE)] == ["r0-0"]


def test_a_spare_under_each_copies_blocking_and_changes_no_bit(
    small_dataset: Path, tmp_path: Path
) -> None:
    """Two groups of two and a warm spare; r0-1 killed. Under ``each`` every slot's rounds
    are the group's collectives from the step's first slot on, before a holder's copy
    could be served: the copy blocks the epoch's start (``copy_rule``; overlapped, every
    collective of the epoch timed out), and the bits are the run's without the kill.
    30 steps, the kill at 18: a 12-step run is over in about half a second here, too soon
    for the spare to be prepared and promoted in some runs."""
    steps, spares = 30, {"spares": 1}
    clean = _run(small_dataset, tmp_path / "clean", 4, "each", steps, cluster=spares)
    kill = [{"kind": "kill", "target": "r0-1", "at_step": steps * 3 // 5}]
    run_dir = tmp_path / "run"
    s = _run(small_dataset, run_dir, 4, "each", steps, cluster=spares, chaos={"faults": kill})
    assert s["final_hash"] == clean["final_hash"]
    assert s["replica_hashes_agree"]
    got = [e for e in events(run_dir, ev.STATE_RECEIVED) if e["worker"] == "spare-0"]
    assert len(got) == 1 and got[0]["mode"] == "blocking", got
    epoch = next(e for e in events(run_dir, ev.EPOCH_STARTED) if e["epoch"] == got[0]["epoch"])
    assert "first" not in epoch, epoch
