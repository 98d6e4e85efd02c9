from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from perdure.runtime.plan import apportion, chain_order, group_order, make_plan, rebalance


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
