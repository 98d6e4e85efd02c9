"""Plans: which member of a membership epoch computes which slots. Pure functions.

A plan gives every member a contiguous range of slot indices, in chain order (the order
in which the deterministic reduction visits members). Members of one region are kept
adjacent so that the chain crosses regions R-1 times. A plan never changes the math: the
reduction adds slot gradients in slot order whoever holds them.

A *rotated* plan starts at a slot other than 0 and wraps: its ranges run over
``[offset, offset + S)`` and slot ``s`` of a range is slot ``s mod S``. Only a redone step
takes one (:func:`redo_plan` with ``rotate``), where the reduction's result does not depend
on the order it meets the slots (the exact reduction's integers): after a loss the
survivors keep whole what they finished, and the lost member's slots go to both of its
neighbours, whichever end of the order it held.

Limit: every member holds at least one slot, so a membership epoch has at most S members;
extra workers wait as spares. The one exception is an epoch's first step while receivers
copy state behind it (:func:`idle_plan`): there a receiver's range is empty.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Plan:
    """Members in chain order and each one's slot range ``[lo, hi)``; a range is empty
    only in an idle plan's first step (:func:`idle_plan`), and some range is not."""

    members: tuple[str, ...]
    ranges: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        assert len(self.members) == len(self.ranges)
        assert all(lo <= hi for lo, hi in self.ranges), self.ranges
        assert self.ranges and self.slots > 0 and 0 <= self.offset < self.slots, self.ranges
        assert all(a[1] == b[0] for a, b in zip(self.ranges, self.ranges[1:], strict=False))

    @property
    def offset(self) -> int:
        """The slot the first range starts at: 0 but in a rotated plan (the module doc)."""
        return self.ranges[0][0]

    @property
    def slots(self) -> int:
        return self.ranges[-1][1] - self.ranges[0][0]

    def slots_of(self, rank: int) -> Sequence[int]:
        lo, hi = self.ranges[rank]
        if hi <= self.slots:
            return range(lo, hi)
        return [s % self.slots for s in range(lo, hi)]

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


def redo_cost(
    kept: Sequence[set[int]], lag: Sequence[int], ranges: Sequence[tuple[int, int]]
) -> int:
    """The most slots any member must compute under ``ranges``: the slots of its range it
    does not hold finished (``kept``), plus its ``lag`` (slots' worth of time it starts
    late: a member that first receives state)."""
    S = ranges[-1][1] - ranges[0][0]
    return max(
        lag[i] + sum(1 for s in range(lo, hi) if s % S not in kept[i])
        for i, (lo, hi) in enumerate(ranges)
    )


def idle_plan(
    plan: Plan,
    kept: Sequence[set[int]],
    idle: Sequence[str],
    *,
    plan_kept: bool = True,
    rotate: bool = False,
) -> Plan:
    """The plan of an epoch's first step while ``idle`` members (the receivers of an
    overlapped state copy, ``runtime/member/copy_overlap.py``) copy state behind it: each of them
    an empty range, the others (the holders) every slot between them, in ``plan``'s member
    order, shares as ``plan``'s ranges weigh them, and, where a holder kept slots of an
    abandoned attempt (``kept``, by member), the ranges that leave the least to compute
    again (:func:`redo_plan` over the holders alone, ``rotate`` passed on; ``plan_kept``
    False skips that search, for plans too large for it). The slots fix the math, not
    who computes them: the same bits as ``plan``'s. A pure function of its inputs."""
    busy = [i for i, m in enumerate(plan.members) if m not in set(idle)]
    if not busy:
        raise ValueError(f"idle_plan: every member of {list(plan.members)} is idle")
    counts = plan.counts()
    sub = from_counts(
        [plan.members[i] for i in busy], apportion(plan.slots, [counts[i] for i in busy])
    )
    if plan_kept and any(kept[i] for i in busy):
        sub = redo_plan(sub, [kept[i] for i in busy], [0] * len(busy), rotate=rotate)
    ranges, lo, j = [], sub.offset, 0
    for i in range(len(plan.members)):
        if j < len(busy) and busy[j] == i:
            ranges.append(sub.ranges[j])
            lo = sub.ranges[j][1]
            j += 1
        else:
            ranges.append((lo, lo))
    return Plan(plan.members, tuple(ranges))


REDO_MAX_WORK = 1 << 15
"""Most slots x members for which the coordinator plans a redone step (:func:`redo_plan`
takes about 0.1 s of its thread there, 0.7 s at 4096 x 46); beyond, the step is redone
with the epoch's plan."""


def redo_plan(
    plan: Plan, kept: Sequence[set[int]], lag: Sequence[int], *, rotate: bool = False
) -> Plan:
    """The plan for the one step an epoch redoes after a loss (the first-step plan of a
    ``Start``): contiguous ranges over ``plan``'s members in their order, each at least one
    slot, that minimise the most slots any member computes (:func:`redo_cost`). A member
    keeps the slots it finished in the abandoned attempt (salvage), so after a death the
    survivors, who hold most of their own ranges finished, take the lost member's slots
    beside theirs instead of leaving them all to its stand-in, which starts late.
    ``rotate`` (a reduction whose result does not depend on the slots' order): the ranges
    may also start inside a run of slots nobody kept and wrap (a rotated plan, the module
    doc), so that a member lost at either end of the order has two neighbours too; among
    equal costs the unrotated plan wins. A pure function of its inputs; ``plan`` itself
    when nothing is gained. O(n S log S) per start tried (:func:`_wrap_points`: at most
    5 with ``rotate``)."""
    S = plan.slots
    starts = _wrap_points(S, kept) if rotate else [0]
    best: tuple[tuple[int, int], ...] | None = None
    best_key = (0, 0)
    for o in starts:
        ranges = _least(S, [{(s - o) % S for s in k} for k in kept], lag)
        if ranges is None:
            continue
        shifted = tuple((lo + o, hi + o) for lo, hi in ranges)
        key = (redo_cost(kept, lag, shifted), _computed(kept, shifted))
        if best is None or key < best_key:
            best, best_key = shifted, key
    if best is None or best_key[0] >= redo_cost(kept, lag, plan.ranges):
        return plan
    return Plan(plan.members, best)


def _wrap_points(S: int, kept: Sequence[set[int]]) -> list[int]:
    """Where a rotated redo plan may start: slot 0, and the start, quarter points and
    middle of the longest circular run of slots no member kept (the lost member's share,
    split between the members on either side of it): at most 5 plans are searched."""
    held = set().union(*kept) if kept else set()
    if not held or len(held) == S:
        return [0]
    first = next(s for s in range(S) if s in held)
    runs: list[list[int]] = [[]]
    for j in range(1, S + 1):  # circularly, from just after a kept slot
        s = (first + j) % S
        if s in held:
            runs.append([])
        else:
            runs[-1].append(s)
    run = max(runs, key=len)  # the first of the longest
    n = len(run)
    return list(dict.fromkeys([0] + [run[n * q // 4] for q in range(4)]))


def _least(
    S: int, kept: Sequence[set[int]], lag: Sequence[int]
) -> tuple[tuple[int, int], ...] | None:
    """Unrotated ranges of the least feasible cost (feasibility is monotone in it: a
    binary search over :func:`_within`), or None where no cost below every slot is."""
    lo_c, hi_c = 0, S + max(lag, default=0)
    best = None
    while lo_c < hi_c:
        c = (lo_c + hi_c) // 2
        ranges = _within(S, c, kept, lag)
        if ranges is None:
            lo_c = c + 1
        else:
            hi_c, best = c, ranges
    return best if best is not None else _within(S, hi_c, kept, lag)


def _computed(kept: Sequence[set[int]], ranges: Sequence[tuple[int, int]]) -> int:
    """The slots computed in all under ``ranges`` (the tie-break between equal costs)."""
    S = ranges[-1][1] - ranges[0][0]
    return sum(
        1 for i, (lo, hi) in enumerate(ranges) for s in range(lo, hi) if s % S not in kept[i]
    )


def _within(
    S: int, c: int, kept: Sequence[set[int]], lag: Sequence[int]
) -> tuple[tuple[int, int], ...] | None:
    """Contiguous ranges covering the ``S`` slots with every member's cost at most ``c``
    and, among those, the fewest slots computed in all (the most kept slots used); None if
    there are none. A dynamic programme member by member (greedily taking the most slots
    is not optimal: a later member may hold early slots finished), O(S) each with a
    sliding-window minimum."""
    best: list[int | None] = [0] + [None] * S  # end e -> least total cost to reach it
    chosen = []
    for i in range(len(kept)):
        best, starts = _extend(best, c - lag[i], kept[i])
        best = [None if b is None else b + lag[i] for b in best]
        chosen.append(starts)
    if best[S] is None:
        return None
    out, e = [], S
    for starts in reversed(chosen):
        lo = starts[e]
        assert lo is not None
        out.append((lo, e))
        e = lo
    return tuple(reversed(out))


def _extend(
    best: list[int | None], budget: int, kept: set[int]
) -> tuple[list[int | None], list[int | None]]:
    """One more member: for each end ``e``, the least total cost over starts ``lo`` it can
    reach (``best``) plus the slots of ``[lo, e)`` this member does not hold, where those
    are at most ``budget``; and the start that gives it. With ``d[x]`` the slots below
    ``x`` not held (non-decreasing), the cost is ``d[e] - d[lo]``: the valid starts of an
    end form a window that only moves right, and the best of it is a deque's front."""
    S = len(best) - 1
    if budget < 0:
        return [None] * (S + 1), [None] * (S + 1)
    d = [0]
    for s in range(S):
        d.append(d[-1] + (s not in kept))
    out: list[int | None] = [None] * (S + 1)
    starts: list[int | None] = [None] * (S + 1)
    window: deque[int] = deque()  # starts, by increasing best[lo] - d[lo]
    lo_min = 0
    for e in range(1, S + 1):
        lo = e - 1
        if (b := best[lo]) is not None:
            while window and best[window[-1]] - d[window[-1]] >= b - d[lo]:  # type: ignore[operator]
                window.pop()
            window.append(lo)
        while lo_min < e and d[e] - d[lo_min] > budget:
            lo_min += 1
        while window and window[0] < lo_min:
            window.popleft()
        if window:
            j = window[0]
            starts[e] = j
            out[e] = best[j] + d[e] - d[j]  # type: ignore[operator]
    return out, starts
