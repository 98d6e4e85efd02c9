"""Two-tier collectives for the exact reduction: inside each region first, then across.

A flat all-reduce over W ranks spread over R regions makes every rank's data cross the
slow links in rounds whose count grows with W (a ring: 2(W - 1) rounds, each as slow as
its slowest link). Because the exact reduction sums integers, *any* grouping of the
additions gives the same bits, so it can instead:

1. all-reduce inside each region (fast links);
2. combine among the regions' leaders (the lowest rank of each region), whatever the
   worker count: with at most ``DIRECT_MAX`` regions by a *direct exchange* (every leader
   sends its tensor to every other leader at once and folds the R tensors itself: one
   one-way delay over the slow links, where a ring all-reduce takes 2(R - 1) rounds one
   after another, measured at ~3.9 RTT for 4 regions); with more, by the backend's
   all-reduce (the direct exchange sends (R - 1) times the bytes of each leader);
3. broadcast the result from each leader inside its region.

MAX (the block exponents) composes the same way. The tiers are built at the start of a
membership epoch beside the epoch's flat group, from each member's region (exchanged
through the epoch's store prefix), and they die with the epoch. Whether they are used is
``cluster.hierarchical_reduce``: not a math setting, since the sum is exact either way.

The direct exchange folds in rank order; for integers and MAX any order gives the same
bits, which is why it is only used here. The exact reduction sends its whole integer
buffer through the tiers in one exchange (each exchange over the slow links costs round
trips); limit: so nothing overlaps it there (the flat path overlaps one bucket's
conversion with another's exchange).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

DIRECT_MAX = 16
"""Most leaders combined by a direct exchange (beyond, the backend's all-reduce)."""
DIRECT_TAG = 0x7E1


@dataclass(frozen=True)
class Tiers:
    """This member's groups: its region's (None when alone in it) and, for a region's
    leader, the leaders' (None elsewhere, or with one region)."""

    local: Any
    cross: Any
    regions: tuple[str, ...]
    """Every rank's region, by rank."""


def plan_tiers(regions: list[str], rank: int) -> tuple[list[int], list[int]]:
    """``(the ranks of this rank's region, the leaders)``: a pure function of the regions
    by rank. Leaders are each region's lowest rank, in rank order."""
    mine = [r for r, name in enumerate(regions) if name == regions[rank]]
    leaders = [r for r, name in enumerate(regions) if regions.index(name) == r]
    return mine, leaders


def build_tiers(
    store: dist.Store,
    prefix: str,
    rank: int,
    size: int,
    region: str,
    make: Callable[[str, int, int], Any],
    timeout: timedelta,
) -> Tiers | None:
    """Exchange regions under ``prefix`` and build the tiers with ``make(prefix, rank,
    size)`` (the epoch's own group factory); None when there is nothing to gain (one
    region, or one member per region)."""
    sub = dist.PrefixStore(f"{prefix}/tiers", store)
    sub.set(f"region/{rank}", region)
    sub.wait([f"region/{r}" for r in range(size)], timeout)
    regions = [sub.get(f"region/{r}").decode() for r in range(size)]
    mine, leaders = plan_tiers(regions, rank)
    if len(leaders) == 1 or (len(leaders) == size and size > DIRECT_MAX):
        return None  # one region; or one member each, too many for a direct exchange
    tag = str(leaders.index(mine[0]))
    local = make(f"{prefix}/local/{tag}", mine.index(rank), len(mine)) if len(mine) > 1 else None
    cross = make(f"{prefix}/cross", leaders.index(rank), len(leaders)) if rank in leaders else None
    return Tiers(local, cross, tuple(regions))


def tiered_allreduce(tiers: Tiers, t: torch.Tensor, op: Any, timeout: timedelta) -> None:
    """``t`` = the all-reduce of every member's ``t`` with ``op`` (SUM or MAX), in tiers."""
    if tiers.local is not None:
        tiers.local.allreduce([t], _opts(op)).wait(timeout)
    if tiers.cross is not None and tiers.cross.size() <= DIRECT_MAX:
        direct_allreduce(tiers.cross, t, op, timeout)
    elif tiers.cross is not None:
        tiers.cross.allreduce([t], _opts(op)).wait(timeout)
    if tiers.local is not None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        tiers.local.broadcast([t], opts).wait(timeout)


def direct_allreduce(pg: Any, t: torch.Tensor, op: Any, timeout: timedelta) -> None:
    """``t`` = the SUM or MAX of every rank's ``t`` in ``pg``, each rank sending its own to
    every other at once (one round) and folding what it receives. Integers or MAX only:
    any order of the fold gives the same bits for those, not for floats."""
    assert op in (dist.ReduceOp.SUM, dist.ReduceOp.MAX)
    assert not t.is_floating_point() or op == dist.ReduceOp.MAX, t.dtype
    rank, n = pg.rank(), pg.size()
    theirs = [torch.empty_like(t) for _ in range(n - 1)]
    works = [pg.send([t], (rank + k) % n, DIRECT_TAG) for k in range(1, n)]
    works += [pg.recv([theirs[k - 1]], (rank - k) % n, DIRECT_TAG) for k in range(1, n)]
    for w in works:
        w.wait(timeout)
    for other in theirs:
        if op == dist.ReduceOp.SUM:
            t += other
        else:
            torch.maximum(t, other, out=t)


def _opts(op: Any) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts
