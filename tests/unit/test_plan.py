from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from perdure.runtime.plan import (
    apportion,
    chain_order,
    group_order,
    idle_plan,
    make_plan,
    rebalance,
    redo_cost,
    redo_plan,
)


@given(st.integers(1, 64), st.lists(st.floats(0.01, 100), min_size=1, max_size=64))
def test_apportion_gives_every_member_at_least_one_slot_and_sums_to_s(
    slots: int, weights: list[float]
) -> None:
    if len(weights) > slots:
        with pytest.raises(ValueError, match="at least one"):
            apportion(slots, weights)
        return
    counts = apportion(slots, weights)
    assert sum(counts) == slots and min(counts) >= 1


def test_even_weights_give_an_even_plan_with_contiguous_ranges() -> None:
    plan = make_plan(["a", "b", "c"], 8)
    assert plan.counts() == [3, 3, 2]
    assert plan.ranges == ((0, 3), (3, 6), (6, 8))


def test_chain_order_keeps_a_regions_workers_adjacent() -> None:
    workers = [("eu-1", "eu"), ("us-0", "us"), ("eu-0", "eu"), ("us-1", "us")]
    assert chain_order(workers, ["us", "eu"]) == ["us-0", "us-1", "eu-0", "eu-1"]


def test_rebalance_moves_at_most_max_moves_slots_per_call() -> None:
    plan = make_plan(["a", "b", "c", "d"], 16)
    slow = rebalance(plan, [1.0, 0.1, 1.0, 1.0], max_moves=2)
    moved = sum(abs(x - y) for x, y in zip(plan.counts(), slow.counts(), strict=True)) // 2
    assert moved == 2 and slow.counts()[1] == 2


def test_rebalance_returns_slots_once_the_slow_member_recovers() -> None:
    plan = make_plan(["a", "b"], 8)
    for _ in range(5):
        plan = rebalance(plan, [1.0, 0.2], max_moves=1)
    assert plan.counts() == [7, 1]
    for _ in range(5):
        plan = rebalance(plan, [1.0, 1.0], max_moves=1)
    assert plan.counts() == [4, 4]


def test_a_planned_epoch_change_leaves_room_for_stale_heartbeats() -> None:
    from perdure.runtime.control.policy import boundary_margin

    assert boundary_margin(None, 0.1) == 1  # no timing yet: the next step
    assert boundary_margin(2.0, 0.1) == 1  # long steps: a heartbeat is never a step late
    assert boundary_margin(0.06, 0.1) == 4  # 60 ms steps, 100 ms heartbeats
    assert boundary_margin(1e-4, 0.1) == 20  # capped


def test_group_order_fills_groups_inside_regions_first_and_is_the_chain_for_k_1() -> None:
    workers = [("e2", "eu"), ("u0", "us"), ("e0", "eu"), ("u1", "us"), ("e1", "eu"), ("a0", "ap")]
    regions = ["us", "eu", "ap"]
    assert group_order(workers, regions, 1) == chain_order(workers, regions)
    assert group_order(workers, regions, 2) == ["u0", "u1", "e0", "e1", "e2", "a0"]
    assert group_order(workers, regions, 3) == ["e0", "e1", "e2", "u0", "u1", "a0"]
    one = [(f"w{i}", "us") for i in range(5)]
    assert group_order(one, ["us"], 2) == chain_order(one, ["us"])  # one region: the chain


def test_after_a_death_the_survivors_take_the_lost_slots_beside_theirs_not_the_late_spare() -> None:
    """a and b finished their own 4 slots; the spare s, in the lost member's rank, starts
    late (it first receives state): it computes one slot and a and b two each, where the
    epoch's plan leaves all four to it."""
    plan = make_plan(["a", "s", "b"], 12)
    kept = [set(range(4)), set(), set(range(8, 12))]
    first = redo_plan(plan, kept, [0, 1, 0])
    assert first.ranges == ((0, 6), (6, 7), (7, 12))
    assert (redo_cost(kept, [0, 1, 0], plan.ranges), redo_cost(kept, [0, 1, 0], first.ranges)) == (
        5,
        2,
    )


def test_a_redo_with_nothing_kept_is_the_epochs_plan() -> None:
    plan = make_plan(["a", "b", "c"], 9)
    assert redo_plan(plan, [set(), set(), set()], [0, 0, 0]) is plan


def _redo_cases(least_members: int) -> st.SearchStrategy:
    """``((S, kept), lag)`` for 1 to 4 members (at least ``least_members``), S up to 9."""
    return st.integers(least_members, 4).flatmap(
        lambda n: st.tuples(
            st.integers(n, 9).flatmap(
                lambda S: st.tuples(
                    st.just(S),
                    st.lists(st.sets(st.integers(0, S - 1)), min_size=n, max_size=n),
                )
            ),
            st.lists(st.integers(0, 2), min_size=n, max_size=n),
        )
    )


@given(_redo_cases(1))
def test_the_redo_plan_has_the_least_cost_and_then_computes_the_fewest_slots(case) -> None:
    """Against every contiguous plan: the least most-slots-per-member, and among those the
    fewest slots computed in all (no finished slot recomputed that need not be)."""
    (S, kept), lag = case
    n = len(kept)
    plan = make_plan([f"m{i}" for i in range(n)], S)
    got = redo_plan(plan, kept, lag).ranges
    every = [
        tuple(zip((0, *cuts), (*cuts, S), strict=True))
        for cuts in itertools.combinations(range(1, S), n - 1)
    ]

    def total(ranges: tuple[tuple[int, int], ...]) -> int:
        return sum(sum(s not in kept[i] for s in range(*r)) for i, r in enumerate(ranges))

    least = min(redo_cost(kept, lag, r) for r in every)
    assert redo_cost(kept, lag, got) == least
    if got != plan.ranges:
        assert total(got) == min(total(r) for r in every if redo_cost(kept, lag, r) == least)


def test_an_idle_plan_gives_the_receivers_no_slot_and_the_holders_every_slot_in_order() -> None:
    """The receivers of an overlapped copy (``runtime/member/copy_overlap.py``) compute nothing of
    the epoch's first step: empty ranges in their ranks, the holders' ranges contiguous
    over all S slots, shares as the epoch's plan weighs them."""
    plan = make_plan(["a", "s", "b", "t"], 12)
    none = [set(), set(), set(), set()]
    idle = idle_plan(plan, none, ["s", "t"])
    assert idle.members == plan.members
    assert idle.ranges == ((0, 6), (6, 6), (6, 12), (12, 12))
    assert [len(idle.slots_of(r)) for r in range(4)] == [6, 0, 6, 0]
    weighed = idle_plan(make_plan(["a", "s", "b"], 12, [2.0, 1.0, 1.0]), none[:3], ["s"])
    assert weighed.ranges == ((0, 8), (8, 8), (8, 12))


def test_an_idle_plan_keeps_the_holders_salvaged_slots_beside_them() -> None:
    """After a death mid-step a holder's finished slots stay its own (``redo_plan`` over
    the holders): a kept {0..3} and b kept {8..11}; the lost member's slots 4..7 are split
    between them, the spare idle."""
    plan = make_plan(["a", "s", "b"], 12)
    kept = [set(range(4)), set(), set(range(8, 12))]
    idle = idle_plan(plan, kept, ["s"])
    assert idle.ranges == ((0, 6), (6, 6), (6, 12))
    assert idle_plan(plan, kept, ["s"], plan_kept=False).ranges == ((0, 6), (6, 6), (6, 12))
    # a kept 0..4: it takes more of the rest than b, who recomputes all of its range
    first = idle_plan(plan, [set(range(5)), set(), set()], ["s"])
    assert redo_cost([set(range(5)), set()], [0, 0], (first.ranges[0], first.ranges[2])) == 4


def test_a_member_lost_at_the_end_of_the_order_is_split_between_both_neighbours_rotated() -> None:
    """With a reduction whose sum does not depend on the slots' order (``rotate``), the
    redone step's ranges may wrap: c, last in the order, held 8..11; a (0..3 finished)
    and b (4..7) take two each instead of b taking all four. Without ``rotate``, b does."""
    plan = make_plan(["a", "b", "c"], 12)
    kept = [set(range(4)), set(range(4, 8)), set()]
    turned = idle_plan(plan, kept, ["c"], rotate=True)
    assert turned.offset == 10 and turned.ranges == ((10, 16), (16, 22), (22, 22))
    assert list(turned.slots_of(0)) == [10, 11, 0, 1, 2, 3]
    assert list(turned.slots_of(1)) == [4, 5, 6, 7, 8, 9] and list(turned.slots_of(2)) == []
    assert idle_plan(plan, kept, ["c"]).ranges == ((0, 6), (6, 12), (12, 12))
    first = idle_plan(plan, [set(), set(range(4, 8)), set(range(8, 12))], ["a"], rotate=True)
    assert [sorted(first.slots_of(r)) for r in range(3)] == [
        [],
        [2, 3, 4, 5, 6, 7],
        [0, 1, 8, 9, 10, 11],
    ]
    middle = [set(range(4)), set(), set(range(8, 12))]  # nothing to gain: not rotated
    assert idle_plan(plan, middle, ["b"], rotate=True) == idle_plan(plan, middle, ["b"])


@given(_redo_cases(2))
def test_a_rotated_redo_plan_covers_every_slot_once_and_never_costs_more(case) -> None:
    (S, kept), lag = case
    n = len(kept)
    plan = make_plan([f"m{i}" for i in range(n)], S)
    straight, turned = redo_plan(plan, kept, lag), redo_plan(plan, kept, lag, rotate=True)
    assert sorted(s for r in range(n) for s in turned.slots_of(r)) == list(range(S))
    assert all(len(turned.slots_of(r)) >= 1 for r in range(n))
    assert redo_cost(kept, lag, turned.ranges) <= redo_cost(kept, lag, straight.ranges)


def test_an_idle_plan_needs_a_holder() -> None:
    with pytest.raises(ValueError, match="every member"):
        idle_plan(make_plan(["a", "b"], 4), [set(), set()], ["a", "b"])


@pytest.mark.parametrize(
    ("train", "outer", "why"),
    [
        ({}, {}, None),
        ({"reduction_exponents": "carried", "reduction_bits": 64}, {}, None),
        ({"reduction": "chain"}, {}, "train.reduction = 'chain'"),
        ({"reduction_exponents": "step"}, {}, "train.reduction_exponents = 'step'"),
        ({"shard_degree": 2}, {}, None),
        ({"shard_degree": 2, "shard_params": True}, {}, "train.shard_params = true"),
        (
            {"shard_degree": 2, "shard_reduce_slots": "each"},
            {},
            "train.shard_reduce_slots = 'each'",
        ),
        ({"slots": 4, "global_batch": 8}, {"replicas": 4}, "outer.replicas = 4"),
    ],
)
def test_a_copy_overlaps_only_the_exact_reduction_with_carried_exponents_and_whole_params(
    train: dict, outer: dict, why: str | None
) -> None:
    """``copy_rule``: the exact reduction with carried or streamed exponents, parameters
    whole on every rank (replica groups that shard only the optimizer state included) and
    no DiLoCo overlap the copy with the first step; anything else blocks, and says which
    setting made it block."""
    from perdure.run_config import RunConfig, with_overrides
    from perdure.runtime.control.copy_rule import overlap_refusal, overlaps

    cfg = with_overrides(RunConfig(), train=train, outer=outer)
    got = overlap_refusal(cfg.train, cfg.outer)
    assert (got is None) == (why is None) == overlaps(cfg.train, cfg.outer)
    assert why is None or (got is not None and got.startswith(why))
