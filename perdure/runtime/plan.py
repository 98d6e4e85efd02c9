"""Plans: which member of a membership epoch computes which slots. Pure functions.

A plan gives every member a contiguous range of slot indices, in chain order (the order
in which the deterministic reduction visits members). Members of one region are kept
adjacent so that the chain crosses regions R-1 times. A plan never changes the math: the
reduction adds slot gradients in slot order whoever holds them.

Limit: every member holds at least one slot, so a membership epoch has at most S members;
extra workers wait as spares.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """Members in chain order and each one's slot range ``[lo, hi)``."""

    members: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        assert len(self.members) == len(self.ranges)
        assert all(lo < hi for lo, hi in self.ranges), self.ranges
        assert all(a[1] == b[0] for a, b in zip(self.ranges, self.ranges[1:], strict=False))

    @property
    def slots(self) -> int:
        return self.ranges[-1][1]

    def slots_of(self, rank: int) -> range:
        lo, hi = self.ranges[rank]
        return range(lo, hi)

    def counts(self) -> list[int]:
        return [hi - lo for lo, hi in self.ranges]

    def to_dict(self) -> dict[str, object]:
        return {"members": list(self.members), "ranges": [list(r) for r in self.ranges]}

    @staticmethod
    def from_dict(d: dict) -> Plan:
        return Plan(tuple(d["members"]), tuple((int(a), int(b)) for a, b in d["ranges"]))


def chain_order(workers: Sequence[tuple[str, str]], regions: Sequence[str]) -> list[str]:
    """Worker names sorted by (region order, name): a region's workers stay adjacent."""
    rank = {r: i for i, r in enumerate(regions)}
    return [n for n, _ in sorted(workers, key=lambda w: (rank.get(w[1], len(rank)), w[0]))]


def group_order(workers: Sequence[tuple[str, str]], regions: Sequence[str], k: int) -> list[str]:
    """Worker names for an epoch of replica groups of ``k`` consecutive ranks: every group
    that fits inside one region first (regions in order, names in order), then the
    workers left over in each region (as ``chain_order`` has them), which form the groups
    that span regions. A group's members exchange parameters every step, so a group
    inside one region keeps that exchange off the wide-area links; only the leftovers of
    regions whose worker count is not a multiple of k pay it. ``k`` = 1: ``chain_order``."""
    order = chain_order(workers, regions)
    if k <= 1:
        return order
    home = dict(workers)
    whole: list[str] = []
    left: list[str] = []
    for region in dict.fromkeys(home[n] for n in order):
        mine = [n for n in order if home[n] == region]
        cut = len(mine) // k * k
        whole += mine[:cut]
        left += mine[cut:]
    return whole + left


def apportion(slots: int, weights: Sequence[float]) -> list[int]:
    """Split ``slots`` into integer shares proportional to ``weights``, each at least 1.

    Largest-remainder method with ties broken by position: deterministic.
    """
    n = len(weights)
    if not 1 <= n <= slots:
        raise ValueError(f"cannot give {n} members at least one of {slots} slots")
    total = sum(weights)
    exact = [slots * w / total if total > 0 else slots / n for w in weights]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) > slots:
        i = max((j for j in range(n) if counts[j] > 1), key=lambda j: (counts[j] - exact[j], -j))
        counts[i] -= 1
    while sum(counts) < slots:
        i = max(range(n), key=lambda j: (exact[j] - counts[j], -j))
        counts[i] += 1
    return counts


def from_counts(members: Sequence[str], counts: Sequence[int]) -> Plan:
    ranges, lo = [], 0
    for c in counts:
        ranges.append((lo, lo + c))
        lo += c
    return Plan(tuple(members), tuple(ranges))


def make_plan(members: Sequence[str], slots: int, weights: Sequence[float] | None = None) -> Plan:
    """An even plan (or one proportional to ``weights``) over ``members`` in chain order."""
    w = list(weights) if weights is not None else [1.0] * len(members)
    return from_counts(members, apportion(slots, w))


def rebalance(plan: Plan, speeds: Sequence[float], max_moves: int) -> Plan:
    """Move at most ``max_moves`` slots towards shares proportional to ``speeds``.

    Bounded moves keep plans from oscillating on noisy timings: a worker that slows down
    loses a few slots per re-plan, and regains them the same way once it recovers.
    """
    target = apportion(plan.slots, speeds)
    counts = plan.counts()
    for _ in range(max_moves):
        give = max(range(len(counts)), key=lambda i: (counts[i] - target[i], -i))
        take = max(range(len(counts)), key=lambda i: (target[i] - counts[i], -i))
        if counts[give] - target[give] <= 0 or target[take] - counts[take] <= 0:
            break
        counts[give] -= 1
        counts[take] += 1
    return from_counts(plan.members, counts)
