"""The streamed exact reduction (``runtime/comm/streamed.py``): per-block predictions and
their verdict, the step form's bits when rounded against the true maxima, the same bits
whoever holds which slot and however the backward hands the last slot over, 32-bit
accuracy, and a missed prediction computed again in the step runner."""

from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from perdure.config.errors import ConfigError
from perdure.runtime.comm.exact import ExactReducer
from perdure.runtime.comm.exact_kernels import load
from perdure.runtime.comm.readiness import Readiness
from perdure.runtime.comm.streamed import (
    MARGIN,
    ZERO,
    StreamedReducer,
    fitted,
    maxima_of,
    predict,
    used,
)
from perdure.runtime.config import TrainConfig
from tests.gloo_support import run_ranks, run_threads
from tests.runtime_support import small_config, step_runner

S, BLOCK = 8, 256
N = 3 * (1 << 20) + 1000  # three full buckets, then whole blocks and a partial block
TIMEOUT = timedelta(seconds=30)


def _slots(seed: int = 0, n: int = N) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(n, generator=g) * torch.exp(2 * torch.randn(n, generator=g)) for _ in "x" * S
    ]


class _Solo:
    """A one-member comm: runs on the calling thread."""

    pg: Any = None

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        f: Future[Any] = Future()
        f.set_result(fn())
        return f


class _Threaded(_Solo):
    """A comm whose calls run on a thread of their own, as ``Comm``'s do."""

    def submit(self, fn: Callable[[], Any]) -> Future[Any]:
        f: Future[Any] = Future()

        def run() -> None:
            try:
                f.set_result(fn())
            except BaseException as e:  # handed to the caller, as Comm's futures do
                f.set_exception(e)

        threading.Thread(target=run, daemon=True).start()
        return f


def _pass(
    red: StreamedReducer,
    bufs: list[torch.Tensor],
    exps: torch.Tensor | None,
    adds: int | None = None,
) -> Any:
    """Every slot but the last added as it is finished, the last handed to ``finish``, as
    the step runner does (``adds``: what ``open`` is told, default the truth)."""
    buf = torch.empty_like(bufs[0])
    red.open(buf, exps, adds=len(bufs) - 1 if adds is None else adds)
    for b in bufs[:-1]:
        buf.copy_(b)
        red.add(buf)
    buf.copy_(bufs[-1])
    out, true = red.finish(_Solo(), buf, timeout=TIMEOUT, last=buf).result()
    return (None if out is None else out.clone()), true


def _exps(*values: int) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# -- the pure part ------------------------------------------------------------------------


def test_a_blocks_maximum_is_the_exponent_above_all_its_values() -> None:
    peaks = torch.tensor([0.0, 1.0, 0.75, 3e-40, 2.0**100]).view(torch.int32)
    assert maxima_of(peaks).tolist() == [ZERO, 1, 0, -131, 101]


def test_a_block_never_seen_non_zero_is_rounded_against_the_largest_prediction() -> None:
    assert used(_exps(3, ZERO, -7)).tolist() == [3, 3, -7]
    assert used(_exps(ZERO, ZERO)).tolist() == [0, 0]


def test_a_prediction_is_the_maximum_plus_the_margin_and_an_idle_block_keeps_its_own() -> None:
    assert predict(None, _exps(1, ZERO)).tolist() == [1 + MARGIN, ZERO]
    assert predict(_exps(9, 4), _exps(2, ZERO)).tolist() == [2 + MARGIN, 4]


def test_fitted_exponents_are_the_maxima_with_idle_blocks_at_the_largest() -> None:
    assert fitted(_exps(3, ZERO, -2)).tolist() == [3, 3, -2]


def test_streamed_exponents_take_both_widths_and_carried_ones_refuse_32_bits() -> None:
    with pytest.raises(ConfigError, match=r"'carried' needs train\.reduction_bits = 64"):
        TrainConfig(reduction_exponents="carried")
    TrainConfig(reduction="chain", reduction_exponents="carried")  # the chain ignores them
    for bits in (32, 64):
        TrainConfig(reduction="exact", reduction_bits=bits, reduction_exponents="streamed")  # type: ignore[arg-type]


# -- one member ----------------------------------------------------------------------------


def _block_exponents(bufs: list[torch.Tensor]) -> torch.Tensor:
    """The step form's per-block exponents of these slots (the torch ops)."""
    return ExactReducer(0, 1, slots=S, bits=64, block=BLOCK, fused=False)._exponents(bufs)


@pytest.mark.parametrize("bits", [32, 64])
@pytest.mark.parametrize("fused", [True, False])
def test_rounded_against_the_true_maxima_it_is_the_step_forms_sum(fused: bool, bits: int) -> None:
    if fused and load() is None:
        pytest.skip("no C compiler: the fused kernels are not built")
    bufs = _slots()
    bufs[2][7] = float("nan")  # zeroed, as the step form does
    bufs[5][1 << 20 : (1 << 20) + BLOCK] = 0.0  # an all-zero block
    step = ExactReducer(0, 1, slots=S, bits=bits, block=BLOCK, fused=fused)
    want = step.reduce(None, [b.clone() for b in bufs], TIMEOUT)
    red = StreamedReducer(0, 1, slots=S, bits=bits, block=BLOCK, fused=fused)
    measured, maxima = _pass(red, [b.clone() for b in bufs], None)
    assert measured is None
    exps = _block_exponents([b.nan_to_num(nan=0.0) for b in bufs])
    assert torch.equal(torch.where(maxima == ZERO, exps, maxima), exps)
    out, again = _pass(red, bufs, fitted(maxima))
    assert torch.equal(out, want) and torch.equal(again, maxima)


def test_the_last_slot_streamed_behind_its_backward_gives_the_same_bits() -> None:
    """The comm thread reads the last slot bucket by bucket as a 'backward' (here: a
    thread copying it in, in pieces) finishes it."""
    bufs = _slots(4)
    red = StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK)
    _, maxima = _pass(red, bufs, None)
    want, _ = _pass(red, bufs, used(predict(None, maxima)))
    buf = torch.empty_like(bufs[0])
    red.open(buf, used(predict(None, maxima)))
    for b in bufs[:-1]:
        buf.copy_(b)
        red.add(buf)
    buf.fill_(float("nan"))  # what is not final yet must never be read
    ready = Readiness()
    fut = red.finish(_Threaded(), buf, timeout=TIMEOUT, last=buf, ready=ready)
    for lo in range(0, N, 300_001):
        hi = min(N, lo + 300_001)
        buf[lo:hi] = bufs[-1][lo:hi]
        ready.advance(hi)
        time.sleep(0.002)
    out, _ = fut.result(timeout=30)
    assert torch.equal(out, want)


@pytest.mark.parametrize("fused", [True, False])
def test_one_slots_integers_kept_in_its_own_buffer_give_the_separate_accumulators_bits(
    fused: bool,
) -> None:
    """A member with one slot converts it in place (32 bits: no second buffer of P
    values); the bits are the separate accumulator's, outlier lane included."""
    if fused and load() is None:
        pytest.skip("no C compiler: the fused kernels are not built")
    for n, guess in ((N, lambda m: predict(None, m)), (SMALL, _low)):  # _low: outliers
        one = _slots(5, n)[:1]
        red = StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK, fused=fused)
        _, maxima = _pass(red, one, None)
        exps = used(guess(maxima))
        apart, _ = _pass(red, one, exps, adds=1)
        assert not red.aliased and apart is not None
        inside, _ = _pass(red, one, exps)
        assert red.aliased and torch.equal(inside, apart)


def test_an_abandoned_backward_ends_the_streaming_pass() -> None:
    from perdure.runtime.comm.group import Abandoned

    red = StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK)
    buf = torch.zeros(4 * BLOCK)
    red.open(buf, _exps(0, 0, 0, 0))
    fut = red.finish(
        _Threaded(), buf, timeout=TIMEOUT, last=buf, ready=Readiness(), abort=lambda: True
    )
    with pytest.raises(Abandoned):
        fut.result(timeout=10)


@pytest.mark.parametrize("bits", [32, 64])
def test_an_accepted_prediction_is_within_the_folds_error_of_each_blocks_maximum(
    bits: int,
) -> None:
    """Rounded MARGIN (3) bits above each block's maximum, a 32-bit sum of 8 slots keeps
    24 bits at the block's maximum: its error, measured against the block's largest value,
    is below 2**-20 (8 roundings of half a quantum, 2**-24 of the block's maximum each, and
    one to float32) and within 2.5x float32's left fold's worst case (a value far below
    its block's maximum keeps fewer bits of its own, as in the step form); 64 bits are as
    accurate as the fold value by value."""
    bufs = _slots(2)
    red = StreamedReducer(0, 1, slots=S, bits=bits, block=BLOCK)
    _, maxima = _pass(red, bufs, None)
    out, _ = _pass(red, bufs, used(predict(None, maxima)))
    exact = torch.stack([b.double() for b in bufs]).sum(0)
    fold = sum(bufs[1:], bufs[0].clone())
    full = N // BLOCK * BLOCK
    top = exact[:full].abs().view(-1, BLOCK).amax(1, keepdim=True)

    def by_block(x: torch.Tensor) -> float:
        return float(((x[:full].double() - exact[:full]).abs().view(-1, BLOCK) / top).max())

    assert by_block(out) <= min(2**-20, 2.5 * by_block(fold))
    if bits == 64:
        rel = (out.double() - exact).abs() / exact.abs()
        rel_fold = (fold.double() - exact).abs() / exact.abs()
        assert float(rel.median()) <= float(rel_fold.median())


@pytest.mark.parametrize("bits", [32, 64])
def test_a_pass_resumed_from_an_abandoned_ones_partial_sum_gives_the_whole_pass_bits(
    bits: int,
) -> None:
    """Salvage across a membership change (``replica/salvage.py``): a pass abandoned after
    three slots keeps their integers, peaks and outlier blocks (every 257th block is
    predicted too low: the outlier lane); a new reducer's pass starts from them, adds the
    other slots in another order and ends with the one pass's sum and maxima, bit for bit."""
    bufs = _slots(5)
    _, maxima = _pass(StreamedReducer(0, 1, slots=S, bits=bits, block=BLOCK), bufs, None)
    exps = _few_low(maxima)
    want, want_max = _pass(StreamedReducer(0, 1, slots=S, bits=bits, block=BLOCK), bufs, exps)
    assert want is not None and int((maxima > exps).sum()) > 0  # the lane is taken
    old = StreamedReducer(0, 1, slots=S, bits=bits, block=BLOCK)
    buf = torch.empty_like(bufs[0])
    assert not old.open(buf, exps, adds=S - 1)
    for i in (0, 1, 2):
        buf.copy_(bufs[i])
        old.add(buf)
    kept = old.partial()
    assert kept is not None and kept.added == 3 and kept.outliers.kept
    assert old.ints.numel() == 0  # let go: the kept integers are never written again
    out, got_max = _resumed(kept, exps, [bufs[i] for i in (6, 3, 5, 4, 7)], bits)
    assert torch.equal(out, want) and torch.equal(got_max, want_max)


def _resumed(kept: Any, exps: torch.Tensor, rest: list[torch.Tensor], bits: int = 32) -> Any:
    """A one-member pass started from ``kept`` that adds ``rest`` (the last streamed)."""
    red = StreamedReducer(0, 1, slots=S, bits=bits, block=BLOCK)
    buf = torch.empty_like(rest[0])
    assert red.open(buf, exps, adds=S - 1, resume=kept)
    for b in rest[:-1]:
        buf.copy_(b)
        red.add(buf)
    buf.copy_(rest[-1])
    return red.finish(_Solo(), buf, timeout=TIMEOUT, last=buf).result()


def test_a_member_whose_reduction_fails_after_its_last_bucket_keeps_its_whole_sum() -> None:
    """Two ranks in threads over gloo: rank 0 adds three slots and streams its last; rank
    1 never enters the reduction, so rank 0's all-reduce fails (1 s timeout) after every
    bucket went on the wire from the last slot's buffer (``_wire``). Its four slots'
    integers are intact: a one-member pass resumed from them that adds the other four
    slots gives the one-member pass over all eight, bit for bit."""
    from perdure.runtime.comm.group import Comm

    bufs = _slots(8, n=3 * BLOCK * 64 + 5)
    exps = predict(None, _pass(StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK), bufs, None)[1])
    want, want_max = _pass(StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK), bufs, exps)
    store, short = dist.HashStore(), timedelta(seconds=1)

    def member(rank: int) -> Any:
        comm = Comm(store, "w", rank, 2, short, lambda: False)
        if rank == 1:
            return None  # never reduces
        red = StreamedReducer(0, 2, slots=S, bits=32, block=BLOCK)
        buf = torch.empty_like(bufs[0])
        red.open(buf, exps, adds=3)
        for i in (0, 1, 2):
            buf.copy_(bufs[i])
            red.add(buf)
        buf.copy_(bufs[3])
        fut = red.finish(comm, buf, timeout=short, last=buf)
        with pytest.raises(Exception):  # noqa: B017 (gloo's timeout or a closed peer)
            comm.result(fut)
        return red.partial()

    kept = run_threads(member, 2)[0]
    assert kept is not None and kept.added == 4
    out, got_max = _resumed(kept, exps, bufs[4:])
    assert torch.equal(out, want) and torch.equal(got_max, want_max)


def test_a_partial_sum_is_refused_against_other_exponents_and_none_is_kept_unsummed() -> None:
    bufs = _slots(6, n=4 * BLOCK)
    exps = predict(None, _pass(StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK), bufs, None)[1])
    red = StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK)
    buf = bufs[0].clone()
    red.open(buf, None, adds=S - 1)  # a measuring pass: no sum to keep
    red.add(buf)
    assert red.partial() is None
    red.open(buf, exps, adds=S - 1)
    assert red.partial() is None  # nothing added yet
    red.add(buf)
    kept = red.partial()
    assert kept is not None
    other = StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK)
    assert not other.open(buf, exps + 1, adds=S - 1, resume=kept)
    assert other.added == 0 and other.ints is not kept.ints


def test_a_member_without_slots_adds_zeros() -> None:
    red = StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK)
    buf = torch.full((4 * BLOCK,), 7.0)
    red.open(buf, _exps(0, 0, 0, 0))
    out, maxima = red.finish(_Solo(), buf, timeout=TIMEOUT).result()
    assert maxima.tolist() == [ZERO] * 4 and out is not None and not out.any()


def test_exponents_of_the_wrong_length_are_refused() -> None:
    red = StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK)
    with pytest.raises(ValueError, match="3 blocks for a buffer of 4"):
        red.open(torch.zeros(4 * BLOCK), _exps(0, 0, 0))


# -- several members -----------------------------------------------------------------------

ASSIGNMENTS = (
    [[0, 1, 2], [3, 4], [5, 6, 7]],
    [[7], [0, 2, 4, 6], [1, 3, 5]],
    [[], [0, 1, 2, 3, 4, 5, 6], [7]],
)
SMALL = 5 * BLOCK + 17


def _rank(rank: int, world: int, port: int, q: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, TIMEOUT)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("s/", store), rank, world, TIMEOUT)
    comm = _Threaded()
    comm.pg = pg
    bufs = _slots(3, SMALL)

    def one_pass(red: StreamedReducer, mine: list[int], exps: torch.Tensor | None) -> Any:
        buf = torch.empty(SMALL)
        red.open(buf, exps, adds=max(0, len(mine) - 1))  # one slot: integers in place
        for s in mine[:-1]:
            buf.copy_(bufs[s])
            red.add(buf)
        ready = Readiness() if mine else None
        fut = red.finish(comm, buf, timeout=TIMEOUT, last=buf if mine else None, ready=ready)
        if mine:
            buf.copy_(bufs[mine[-1]])
            ready.advance(SMALL)  # type: ignore[union-attr]
        return fut.result(timeout=30)

    for i, assignment in enumerate(ASSIGNMENTS):
        for bits in (32, 64):
            red = StreamedReducer(rank, world, slots=S, bits=bits, block=BLOCK)
            _, maxima = one_pass(red, assignment[rank], None)
            low, _ = one_pass(red, assignment[rank], used(_low(maxima)))
            pred = predict(None, maxima)
            out, _ = one_pass(red, assignment[rank], used(pred))
            q.put((i, bits, rank, maxima.tolist(), low.numpy().tobytes(), out.numpy().tobytes()))


def test_three_ranks_with_any_slot_assignment_give_the_one_rank_bits_with_outliers_too() -> None:
    got = {(i, b, r): rest for i, b, r, *rest in run_ranks(_rank, 3, 6 * len(ASSIGNMENTS))}
    bufs = _slots(3, SMALL)
    for bits in (32, 64):
        red = StreamedReducer(0, 1, slots=S, bits=bits, block=BLOCK)
        _, maxima = _pass(red, bufs, None)
        want, _ = _pass(red, bufs, used(predict(None, maxima)))
        low, _ = _pass(red, bufs, used(_low(maxima)))
        if bits == 32:  # the outlier lane is another rounding (at 64 bits it rounds alike)
            assert not torch.equal(low, want)
        for i in range(len(ASSIGNMENTS)):
            for r in range(3):
                expect = [maxima.tolist(), low.numpy().tobytes(), want.numpy().tobytes()]
                assert got[(i, bits, r)] == expect, (i, bits, r)


def _low(maxima: torch.Tensor) -> torch.Tensor:
    """A prediction that every other block outgrows (by 1 to 3 bits): the outlier lane."""
    drop = 1 + torch.arange(maxima.numel(), dtype=torch.int32) % 3
    low = torch.where(torch.arange(maxima.numel()) % 2 == 0, maxima - drop, maxima + MARGIN)
    return torch.where(maxima == ZERO, maxima, low)


# -- in the step runner --------------------------------------------------------------------


def test_a_missed_prediction_takes_the_outlier_lane_and_an_explosion_is_computed_again(
    small_dataset: Path,
) -> None:
    train = {"reduction": "exact", "reduction_bits": 32, "reduction_exponents": "streamed"}
    events: list[dict[str, Any]] = []
    run = step_runner(small_config(small_dataset, workers=1, train=train), events)
    tr = run.tr
    first = run.gradient(0, 0.0).clone()  # nothing carried: a measuring pass, then the sum
    assert events == [] and len(run.bufs) == 1  # one slot buffer for 8 slots
    staged = tr._staged
    assert isinstance(staged, torch.Tensor) and tr.exponents is None
    maxima = staged - MARGIN
    every8th = torch.arange(maxima.numel()) % 8 == 0
    tr.exponents = torch.where(every8th & (staged != ZERO), maxima - 2, staged)
    # an eighth of the blocks outgrow it: the outlier lane, one pass
    lane = run.gradient(0, 0.0).clone()
    assert events == [] and torch.equal(tr._staged, staged)
    grads = tr.layout.grads
    assert float((grads(lane) - grads(first)).abs().max()) <= 2**-20 * float(first.abs().max())
    tr.exponents = torch.where(staged != ZERO, staged - 20, staged)  # past the outliers' cap
    assert torch.equal(run.gradient(0, 0.0), first)
    assert events == [{"event": "exponents_refit", "step": 0}]
    tr.exponents = staged
    run.gradient(0, 0.0)
    assert len(events) == 1  # as predicted: one pass


@pytest.mark.parametrize("copy_done", [True, False])
def test_a_holder_whose_copy_is_out_computes_its_last_slot_before_the_gate_same_bits(
    small_dataset: Path, copy_done: bool
) -> None:
    """An overlapped copy's holder passes its gate before the first bucket goes on the
    wire: where the copy is still out, it computes its last slot whole first instead of
    waiting idle, and the sum is the same bits as the streamed one."""
    train = {"reduction": "exact", "reduction_bits": 32, "reduction_exponents": "streamed"}
    cfg = small_config(small_dataset, workers=1, train=train)
    runs = [step_runner(cfg, []) for _ in range(2)]
    for r in runs:  # step 0 has no carried exponents: a measuring pass, then the sum's;
        r.gradient(0, 0.0)  # carried from it, a step is one pass
        r.tr.exponents = r.tr._staged
    want, run = runs[0].gradient(0, 0.0), runs[1]
    seen: list[str] = []
    compute = run.tr.engine.compute

    def counted(*args: Any, **kwargs: Any) -> Any:
        seen.append("compute")
        return compute(*args, **kwargs)

    class Gate:
        def ready(self) -> bool:
            return copy_done

        def __call__(self) -> None:
            seen.append("gate")

    run.tr.engine.compute = counted  # type: ignore[method-assign]
    run.gate = Gate()
    assert torch.equal(run.gradient(0, 0.0), want)
    slots = len(run.slots)
    last_before_gate = ["compute"] * slots + ["gate"]
    streamed = ["compute"] * (slots - 1) + ["gate", "compute"]
    assert seen == (streamed if copy_done else last_before_gate)


def test_received_exponents_that_are_not_an_int32_tensor_are_refused(small_dataset: Path) -> None:
    from perdure.runtime.replica.trainer import Trainer

    train = {"reduction": "exact", "reduction_bits": 32, "reduction_exponents": "streamed"}
    tr = Trainer(small_config(small_dataset, workers=1, train=train))
    model, optim, extra = tr.export()
    for bad in ([1, 2], torch.zeros(3), torch.zeros(2, 2, dtype=torch.int32)):
        with pytest.raises(ValueError, match=r"the received state: optimizer\.reduction\.exp"):
            tr.adopt(model, {**optim, "reduction": {"exponents": bad}}, extra)
    tr.adopt(model, {**optim, "reduction": {"exponents": _exps(-5, 3)}}, extra)
    assert tr.exponents is not None and tr.exponents.tolist() == [-5, 3]  # type: ignore[union-attr]


# -- several regions -----------------------------------------------------------------------

REGIONS = ["a", "a", "b", "c", "c"]  # b's leader alone in its region; 3 leaders exchange
BY_RANK = [[0, 1], [2], [3, 4, 5], [6], [7]]
WIDE = 2 * (1 << 20) + BLOCK + 17  # two full buckets, one of a block, a partial block


def _few_low(maxima: torch.Tensor) -> torch.Tensor:
    """:func:`_low` on every 257th block only, the rest predicted: under the outlier cap of
    a wide buffer (a member keeps at most 1/64 of it)."""
    some = torch.arange(maxima.numel()) % 257 == 0
    return torch.where(some, _low(maxima), predict(None, maxima))


def _region_rank(rank: int, world: int, port: int, q: mp.Queue, direct: bool = True) -> None:
    from perdure.runtime.comm.group import Comm

    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, TIMEOUT)
    comm = Comm(store, "r/", rank, world, TIMEOUT, lambda: False)
    comm.add_tiers(store, REGIONS[rank], direct=direct)
    assert comm.tiers is not None and comm.tiers.direct == direct
    bufs, mine = _slots(6, WIDE), BY_RANK[rank]

    def one_pass(red: StreamedReducer, exps: torch.Tensor | None) -> Any:
        buf = torch.empty(WIDE)
        red.open(buf, exps, adds=len(mine) - 1)
        for s in mine[:-1]:
            buf.copy_(bufs[s])
            red.add(buf)
        buf.fill_(float("nan"))  # what is not final yet must never be read
        ready = Readiness()
        fut = red.finish(comm, buf, timeout=TIMEOUT, last=buf, ready=ready)
        for lo in range(0, WIDE, 500_001):  # the 'backward', in pieces
            hi = min(WIDE, lo + 500_001)
            buf[lo:hi] = bufs[mine[-1]][lo:hi]
            ready.advance(hi)
            time.sleep(0.005)
        return fut.result(timeout=60)

    red = StreamedReducer(rank, world, slots=S, bits=32, block=BLOCK)
    _, maxima = one_pass(red, None)
    low, _ = one_pass(red, used(_few_low(maxima)))
    out, _ = one_pass(red, used(predict(None, maxima)))
    q.put((rank, maxima.tolist(), low.numpy().tobytes(), out.numpy().tobytes()))


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "ring"])
def test_buckets_streamed_across_regions_give_the_one_rank_bits_with_outliers_too(
    direct: bool,
) -> None:
    """Five members in three regions (one alone in its own): each bucket of the last slot
    goes through its region's all-reduce and the leaders' direct exchange (or their ring
    all-reduce: ``cluster.cross_region_reduce``) as its 'backward' finishes it; the sums
    are the one-rank pass's bits, outlier lane included."""
    target = partial(_region_rank, direct=direct)
    got = {r: rest for r, *rest in run_ranks(target, len(REGIONS), len(REGIONS), 120)}
    bufs = _slots(6, WIDE)
    red = StreamedReducer(0, 1, slots=S, bits=32, block=BLOCK)
    _, maxima = _pass(red, bufs, None)
    want, _ = _pass(red, bufs, used(predict(None, maxima)))
    low, _ = _pass(red, bufs, used(_few_low(maxima)))
    assert low is not None and not torch.equal(low, want)
    for r in range(len(REGIONS)):
        assert got[r] == [maxima.tolist(), low.numpy().tobytes(), want.numpy().tobytes()], r
