from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from perdure.runtime.plan import (
    apportion,
    chain_order,
    group_order,
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


@given(
    st.integers(1, 4).flatmap(
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
)
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
