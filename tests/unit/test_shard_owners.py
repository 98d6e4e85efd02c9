"""The pure parts of replica-group sharding: who owns a parameter, who sends a shard, and
optimizer state dicts cut and merged by shard."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from perdure.runtime.shard_plan import ALL, NONE, complete, merge, owners, part, shard_of, sources


def test_owners_balance_bytes_largest_first_and_do_not_depend_on_anything_else() -> None:
    sizes = [10, 400, 30, 400, 5, 200]
    got = owners(sizes, 2)
    assert got == owners(list(sizes), 2)  # a pure function
    assert got == [1, 0, 1, 1, 1, 0]  # 400 -> 0, 400 -> 1, 200 -> 0, then 30, 10, 5 -> 1
    load = [sum(s for s, o in zip(sizes, got, strict=True) if o == j) for j in range(2)]
    assert load == [600, 445]
    assert owners(sizes, 1) == [0] * len(sizes)


def test_a_shard_degree_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="shard degree must be >= 1"):
        owners([1, 2], 0)


def test_each_member_that_lacks_its_shard_gets_it_from_the_lowest_holder() -> None:
    # k = 2, four ranks: rank r owns shard r % 2. Ranks 0 and 1 swapped shards (a kill
    # moved them), rank 2 is fresh, rank 3 holds shard 1 already.
    assert sources([1, 0, NONE, 1], 2) == {0: 1, 1: 0}
    assert sources([0, 1, 0, 1], 2) == {}  # everyone holds its own
    assert sources([ALL, NONE], 2) == {1: 0}  # a checkpoint just loaded holds every shard
    assert [shard_of(r, 3) for r in range(6)] == [0, 1, 2, 0, 1, 2]


def test_a_shard_nobody_holds_is_named() -> None:
    with pytest.raises(LookupError, match="optimizer shard 1 of 2 is held by no member"):
        sources([0, NONE], 2)
    assert not complete([0, 0], 2, 2)
    assert complete([1, 0], 2, 4) and complete([ALL], 3, 6)
    assert complete([0], 2, 1)  # one rank needs only shard 0


def test_a_state_cut_by_shard_merges_back_to_the_same_dict() -> None:
    state = {
        "state": {0: {"step": 1}, 1: {"step": 2}, 2: {"step": 3}},
        "param_groups": [{"lr": 0.1, "params": [0, 1, 2]}],
        "scheduler": {"last_epoch": 4},
    }
    owner = [1, 0, 1]
    parts = [part(state, owner, j) for j in range(2)]
    assert parts[0]["state"] == {1: {"step": 2}}
    assert parts[1]["param_groups"] == state["param_groups"]
    assert parts[1]["scheduler"] == state["scheduler"]
    assert merge(parts[::-1]) == state


def test_unit_owners_keep_each_unit_on_one_shard_balanced_by_size() -> None:
    """Units [0, 1] (410 values), [2, 3] (430), [4] (5) and the tied parameter 1 again in
    a later unit (it stays with its first); parameter 5 is in no unit (a unit alone)."""
    from perdure.runtime.shard_plan import unit_owners

    sizes = [10, 400, 30, 400, 5, 200]
    got = unit_owners([[0, 1], [2, 3], [4, 1]], sizes, 2)
    assert got[0] == got[1] and got[2] == got[3]
    assert got == [1, 1, 0, 0, 0, 1]  # 430 -> 0, 410 -> 1, 200 -> 1, 5 -> 0
    assert unit_owners([[0, 1], [2, 3], [4, 1]], sizes, 1) == [0] * 6


def test_fingerprints_are_compared_among_the_ranks_that_hold_the_same_tensors() -> None:
    """Sharded at rest, a rank's CRC of a parameter it does not hold is -1: ranks 0 and 2
    hold shard 0, ranks 1 and 3 shard 1, and each pair is compared on its own."""
    from perdure.runtime.step import _holding_classes

    values = [(5, 7, -1), (5, -1, 9), (5, 7, -1), (5, -1, 8)]
    assert _holding_classes(values) == [[0, 2], [1, 3]]
    assert _holding_classes([(1, 2), (1, 3)]) == [[0, 1]]  # unsharded: one class


def test_contiguous_owners_give_each_shard_one_run_with_the_least_largest_load() -> None:
    """Positions [100, 1, 1, 100, 50, 50] in 2 runs: the least largest load is 152
    (100 + 1 + 1 | 100 + 50 + 50 would be 200), so the cut falls after position 2."""
    from perdure.runtime.shard_plan import contiguous_owners, shard_ranges

    sizes = [100, 1, 1, 100, 50, 50]
    items = [[i] for i in range(len(sizes))]
    got = contiguous_owners(items, sizes, 2)
    assert got == [0, 0, 0, 1, 1, 1]
    assert shard_ranges(got, sizes, 2) == [(0, 102), (102, 302)]
    # a unit kept whole: [2, 3] cannot be split, so the cut moves before it
    assert contiguous_owners([[0], [1], [2, 3], [4], [5]], sizes, 2) == [0, 0, 1, 1, 1, 1]
    # more shards than items: the last shards get empty ranges where they would begin
    assert contiguous_owners([[0, 1]], [3, 4], 3) == [0, 0]
    assert shard_ranges([0, 0], [3, 4], 3) == [(0, 7), (7, 7), (7, 7)]


def test_contiguous_owners_are_none_when_the_items_cannot_be_runs() -> None:
    from perdure.runtime.shard_plan import contiguous_owners

    assert contiguous_owners([[0, 2], [1]], [1, 1, 1], 2) is None  # interleaved
    assert contiguous_owners([[0], [2]], [1, 1, 1], 2) is None  # position 1 in no item


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 50), min_size=1, max_size=12),
    k=st.integers(1, 5),
    data=st.data(),
)
def test_contiguous_owners_are_optimal_among_every_cut(
    sizes: list[int], k: int, data: st.DataObject
) -> None:
    """Against brute force: runs in position order, units whole, and no cut into at most
    k runs has a smaller largest load."""
    from perdure.runtime.shard_plan import contiguous_owners, shard_ranges

    n = len(sizes)
    cuts = sorted(data.draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else [])
    bounds = [0, *cuts, n]
    items = [list(range(a, b)) for a, b in itertools.pairwise(bounds)]
    got = contiguous_owners(items, sizes, k)
    assert got is not None
    assert got == sorted(got) and got[0] == 0 and got[-1] < k
    for it in items:
        assert len({got[i] for i in it}) == 1
    loads = [sum(sizes[lo:hi]) for lo, hi in itertools.pairwise(bounds)]
    best = min(
        max(sum(loads[a:b]) for a, b in zip((0, *c), (*c, len(loads)), strict=True))
        for r in range(min(k, len(loads)))
        for c in itertools.combinations(range(1, len(loads)), r)
    )
    assert max(sum(s for s, o in zip(sizes, got, strict=True) if o == j) for j in range(k)) == best
    ranges = shard_ranges(got, sizes, k)
    assert ranges[0][0] == 0 and ranges[-1][1] == sum(sizes)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
