"""The two-tier exact reduction: inside regions, then across; the same bits as flat."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from perdure.runtime.comm.exact import ExactReducer
from perdure.runtime.comm.group import Comm
from perdure.runtime.comm.tiers import plan_tiers
from tests.gloo_support import run_threads
from tests.runtime_support import events, run_to_end, small_config

TIMEOUT = timedelta(seconds=30)


def test_tiers_are_each_regions_ranks_and_one_leader_per_region() -> None:
    regions = ["eu", "eu", "us", "us", "us", "ap"]
    assert plan_tiers(regions, 3) == ([2, 3, 4], [0, 2, 5])
    assert plan_tiers(regions, 5) == ([5], [0, 2, 5])


def _reduce_all(
    regions: list[str], slots: list[list[torch.Tensor]], *, direct: bool = True
) -> list[list[torch.Tensor]]:
    """Each rank in a thread: flat and tiered exact sums of its slots (the leaders
    combining by the direct exchange, or by the backend's all-reduce)."""
    store = dist.HashStore()

    def rank_main(r: int) -> list[torch.Tensor]:
        comm = Comm(store, "t", r, len(regions), TIMEOUT, lambda: False)
        comm.add_tiers(store, regions[r], direct=direct)
        alone = len(set(regions)) == len(regions)
        if not direct and alone:  # the flat all-reduce is then the leaders' own
            assert comm.tiers is None
        else:
            assert comm.tiers is not None and comm.tiers.regions == tuple(regions)
            assert comm.tiers.direct == direct
        red = ExactReducer(r, len(regions), slots=8, bits=64, block=16)
        flat = red.reduce(comm.pg, slots[r], TIMEOUT).clone()
        tiered = red.reduce(comm.pg, slots[r], TIMEOUT, tiers=comm.tiers).clone()
        return [flat, tiered]

    return run_threads(rank_main, len(regions))


def test_a_tiered_sum_is_bitwise_the_flat_sum_and_the_single_process_sum() -> None:
    g = torch.Generator().manual_seed(0)
    regions = ["a", "a", "b", "b", "b"]
    counts = [2, 1, 2, 2, 1]
    slots = [[torch.randn(1000, generator=g) * 10 ** (i % 5) for i in range(c)] for c in counts]
    alone = ExactReducer(0, 1, slots=8, bits=64, block=16)
    reference = alone.reduce(None, [b.clone() for rank in slots for b in rank], TIMEOUT)
    results = _reduce_all(regions, [[b.clone() for b in rank] for rank in slots])
    for flat, tiered in results:
        assert torch.equal(flat, reference) and torch.equal(tiered, reference)


def test_a_run_over_two_regions_with_tiers_equals_one_worker(
    small_dataset: Path, tmp_path: Path
) -> None:
    exact = {"reduction": "exact"}
    one = run_to_end(small_config(small_dataset, workers=1, steps=16, train=exact), tmp_path / "a")
    four = small_config(small_dataset, workers=4, regions=2, steps=16, train=exact)
    assert four.cluster.hierarchical_reduce
    s = run_to_end(four, tmp_path / "b")
    assert s["replica_hashes_agree"] and s["final_hash"] == one["final_hash"]
    assert not events(tmp_path / "b", "collective_failed")


def test_one_member_per_region_is_combined_by_the_direct_exchange_with_the_same_bits() -> None:
    g = torch.Generator().manual_seed(1)
    regions = ["a", "b", "c", "d"]
    slots = [[torch.randn(777, generator=g) * 10**r for _ in range(2)] for r in range(4)]
    alone = ExactReducer(0, 1, slots=8, bits=64, block=16)
    reference = alone.reduce(None, [b.clone() for rank in slots for b in rank], TIMEOUT)
    for flat, tiered in _reduce_all(regions, [[b.clone() for b in rank] for rank in slots]):
        assert torch.equal(flat, reference) and torch.equal(tiered, reference)


def test_leaders_combined_by_the_backends_all_reduce_give_the_same_bits() -> None:
    g = torch.Generator().manual_seed(2)
    regions = ["a", "a", "b", "c", "c"]
    slots = [[torch.randn(999, generator=g) * 10 ** (r % 4) for _ in range(2)] for r in range(5)]
    alone = ExactReducer(0, 1, slots=16, bits=64, block=16)
    reference = alone.reduce(None, [b.clone() for rank in slots for b in rank], TIMEOUT)
    for regions_now in (regions, ["a", "b", "c", "d", "e"]):
        copies = [[b.clone() for b in rank] for rank in slots]
        for flat, tiered in _reduce_all(regions_now, copies, direct=False):
            assert torch.equal(flat, reference) and torch.equal(tiered, reference)
