"""The exact reduction: the same bits whoever holds which slot and however many ranks add
them, with accuracy at least that of a float32 fold."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from perdure.runtime.comm.exact import ExactReducer
from tests.gloo_support import run_ranks

S, N = 8, 5000


def _slots(seed: int = 0) -> list[torch.Tensor]:
    """Heavy-tailed slot gradients (as real ones are: a few large values per block)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(N, generator=g) * torch.exp(3 * torch.randn(N, generator=g)) for _ in range(S)
    ]


def _local(bufs: list[torch.Tensor], bits: int = 64) -> torch.Tensor:
    r = ExactReducer(0, 1, slots=S, bits=bits, block=256)
    return r.reduce(None, [b.clone() for b in bufs], timedelta(seconds=5)).clone()


@pytest.mark.parametrize("bits", [32, 64])
def test_the_sum_does_not_depend_on_the_order_of_the_slots(bits: int) -> None:
    bufs = _slots()
    want = _local(bufs, bits)
    for perm in ([7, 6, 5, 4, 3, 2, 1, 0], [3, 1, 4, 0, 5, 2, 7, 6]):
        assert torch.equal(_local([bufs[i] for i in perm], bits), want)


def test_int64_is_as_accurate_as_one_rounding_of_the_exact_sum() -> None:
    bufs = _slots(1)
    exact = torch.stack([b.double() for b in bufs]).sum(0)
    fold = bufs[0].clone()
    for b in bufs[1:]:
        fold += b
    rel = lambda x: ((x.double() - exact).abs() / exact.abs().clamp_min(1e-30)).median()  # noqa: E731
    assert rel(_local(bufs, 64)) <= rel(exact.float())  # no worse than rounding once to fp32
    assert rel(_local(bufs, 64)) <= rel(fold)


def test_int32_errs_by_at_most_half_a_quantum_per_slot_of_each_blocks_maximum() -> None:
    """int32 keeps 30 - log2(S) bits below each block's maximum: values far below it (heavy
    tails) lose relative precision, which is why int64 is the default."""
    bufs = _slots(1)
    exact = torch.stack([b.double() for b in bufs]).sum(0)
    peak = torch.stack([b.abs() for b in bufs]).amax(0).double()
    block_peak = torch.nn.functional.pad(peak, (0, -N % 256)).view(-1, 256).amax(1)
    quantum = torch.ldexp(torch.ones_like(block_peak), torch.frexp(block_peak)[1] - 27)
    bound = (S / 2 * quantum).repeat_interleave(256)[:N] + exact.abs() * 2.0**-24
    assert ((_local(bufs, 32).double() - exact).abs() <= bound).all()


def test_a_non_finite_slot_is_zeroed_and_the_rest_still_sums_exactly() -> None:
    bufs = _slots(2)
    bad = [b.clone() for b in bufs]
    bad[3][10] = float("nan")
    bad[3][11] = float("inf")
    clean = [b.clone() for b in bufs]
    clean[3][10] = clean[3][11] = 0.0
    got = _local(bad)
    assert torch.isfinite(got).all()
    assert torch.equal(got, _local(clean))


ASSIGNMENTS = ([[0, 1, 2], [3, 4], [5, 6, 7]], [[7], [0, 2, 4, 6], [1, 3, 5]])
CASES = [(a, bits) for a in ASSIGNMENTS for bits in (32, 64)]


def _rank(rank: int, world: int, port: int, q: mp.Queue) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timedelta(seconds=30))
    pg = dist.ProcessGroupGloo(dist.PrefixStore("x/", store), rank, world, timedelta(seconds=30))
    bufs = _slots(3)
    for i, (assignment, bits) in enumerate(CASES):
        r = ExactReducer(rank, world, slots=S, bits=bits, block=256)
        owned = [bufs[s].clone() for s in assignment[rank]]
        q.put((i, rank, r.reduce(pg, owned, timedelta(seconds=30)).numpy().tobytes()))


def test_three_ranks_with_any_slot_assignment_give_the_one_rank_bits() -> None:
    got = {(i, r): out for i, r, out in run_ranks(_rank, 3, 3 * len(CASES))}
    for i, (assignment, bits) in enumerate(CASES):
        want = _local(_slots(3), bits).numpy().tobytes()
        assert all(got[(i, r)] == want for r in range(3)), (assignment, bits)
