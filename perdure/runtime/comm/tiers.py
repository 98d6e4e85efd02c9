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
   after another, measured at ~3.9 RTT for 4 regions); with more, or where
   ``cluster.cross_region_reduce`` asks for it (DiLoCo's outer step by default: one
   reduction per H inner steps, bound by the links' bandwidth, not their delay), by the
   backend's all-reduce (the direct exchange sends R - 1 buffers out of each leader,
   gloo's ring 2(R - 1)/R);
3. broadcast the result from each leader inside its region.

MAX (the block exponents) composes the same way. The tiers are built at the start of a
membership epoch beside the epoch's flat group, from each member's region (exchanged
through the epoch's store prefix), and they die with the epoch. Whether they are used is
``cluster.hierarchical_reduce``: not a math setting, since the sum is exact either way.

The direct exchange folds in rank order; for integers and MAX any order gives the same
bits, which is why it is only used here. The ``step`` and ``carried`` forms send their
whole integer buffer through the tiers in one exchange (each exchange over the slow links
costs round trips); limit: so nothing overlaps it there. The streamed form sends it bucket
by bucket behind the backward (:class:`TieredBuckets`): each bucket's three stages go out
as soon as the one before is done, several buckets in flight at once, the receives posted
before the backward, and the block maxima beside the last bucket, so the slow links carry
the buckets while the backward computes the next ones, and a step pays about one one-way
delay after its last bucket, not one per bucket.
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
BUCKET_TAG = DIRECT_TAG + 1
"""The first bucket's tag in :class:`TieredBuckets` (bucket ``i``: ``+ i % TAG_RANGE``), so
that the buckets in flight never take each other's messages, nor the direct exchange's."""
TAG_RANGE = 1 << 20


@dataclass(frozen=True)
class Tiers:
    """This member's groups: its region's (None when alone in it) and, for a region's
    leader, the leaders' (None elsewhere, or with one region)."""

    local: Any
    cross: Any
    regions: tuple[str, ...]
    """Every rank's region, by rank."""
    direct: bool = True
    """The leaders combine by the direct exchange (else by the backend's all-reduce:
    ``cluster.cross_region_reduce``, or past ``DIRECT_MAX`` leaders)."""


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
    direct: bool = True,
) -> Tiers | None:
    """Exchange regions under ``prefix`` and build the tiers with ``make(prefix, rank,
    size)`` (the epoch's own group factory); None when there is nothing to gain (one
    region; or one member per region where the leaders would not combine by the direct
    exchange: the flat group's all-reduce is then the same collective). ``direct``: the
    leaders combine by the direct exchange (up to ``DIRECT_MAX`` of them)."""
    sub = dist.PrefixStore(f"{prefix}/tiers", store)
    sub.set(f"region/{rank}", region)
    sub.wait([f"region/{r}" for r in range(size)], timeout)
    regions = [sub.get(f"region/{r}").decode() for r in range(size)]
    mine, leaders = plan_tiers(regions, rank)
    direct = direct and len(leaders) <= DIRECT_MAX
    if len(leaders) == 1 or (len(leaders) == size and not direct):
        return None  # one region; or one member each, not combined by a direct exchange
    tag = str(leaders.index(mine[0]))
    local = make(f"{prefix}/local/{tag}", mine.index(rank), len(mine)) if len(mine) > 1 else None
    cross = make(f"{prefix}/cross", leaders.index(rank), len(leaders)) if rank in leaders else None
    return Tiers(local, cross, tuple(regions), direct)


def tiered_allreduce(tiers: Tiers, t: torch.Tensor, op: Any, timeout: timedelta) -> None:
    """``t`` = the all-reduce of every member's ``t`` with ``op`` (SUM or MAX), in tiers."""
    if tiers.local is not None:
        tiers.local.allreduce([t], _opts(op)).wait(timeout)
    if tiers.cross is not None and tiers.direct:
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


class _Flight:
    """One part between its stages: the local all-reduce, the leaders' exchange (the
    sends and the receives, posted early, of a direct exchange; or the backend's
    all-reduce), the fold."""

    def __init__(self, t: torch.Tensor, op: Any, tag: int) -> None:
        self.t, self.op, self.tag = t, op, tag
        self.local: Any = None
        self.recvs: list[Any] = []
        self.theirs: list[torch.Tensor] = []
        self.cross: list[Any] = []

    def ready_to_cross(self) -> bool:
        return self.local is None or bool(self.local.is_completed())


class TieredBuckets:
    """Two-tier reductions of several parts of a buffer (SUM of integers, or MAX), each
    as soon as it is final (the streamed reduction's buckets behind the backward, then
    its block maxima): the same bits as :func:`tiered_allreduce` of each, since integer
    sums and maxima do not depend on the grouping.

    The leaders post every part's receives when the parts are laid out, before any is
    final: gloo sends a message at once only to a peer whose receive is posted (else it
    waits for the peer's notice, one more crossing), so a part's exchange then costs one
    one-way delay over the slow links, not a round trip. :meth:`add` hands a part's
    local all-reduce to the region's group at once; :meth:`poll` (never blocking: the
    caller's wait for the next bucket calls it) sends the part of every leader whose
    local stage is done, in order, with a tag of its own (``BUCKET_TAG + i``);
    :meth:`finish` waits for the parts in order and broadcasts each from its leader
    inside the region. Every member issues its region group's collectives in one order
    (the all-reduces in part order, then the broadcasts in part order), as gloo matches
    them by order; the leaders' exchange is point to point (matched by tag) or, past
    ``DIRECT_MAX`` leaders, all-reduces issued in part order on every leader.

    Limits: the broadcasts inside a region wait for the last part (a fast link; their
    order must not depend on timing); a leader holds ``R - 1`` received copies of the
    buffer (the direct exchange's); a part whose local stage finishes while nobody polls
    is sent at the next poll (the next bucket's wait polls every few milliseconds,
    ``readiness.py``); a pass that ends early (abandoned, failed) leaves its receives
    posted, so its groups must serve no other pass: they do not, since an abandoned or
    failed step ends the membership epoch, whose groups die with it (``worker.py``)."""

    def __init__(
        self, tiers: Tiers, parts: list[tuple[torch.Tensor, Any]], timeout: timedelta
    ) -> None:
        self.tiers, self.timeout = tiers, timeout
        cross = tiers.cross
        self.direct = cross is not None and tiers.direct
        self.flights = [
            _Flight(t, op, BUCKET_TAG + i % TAG_RANGE) for i, (t, op) in enumerate(parts)
        ]
        self.added = 0
        self.crossed = 0
        """Parts whose leaders' exchange is issued (a prefix: they go in order)."""
        if self.direct:
            rank, n = cross.rank(), cross.size()
            for f in self.flights:
                f.theirs = [torch.empty_like(f.t) for _ in range(n - 1)]
                f.recvs = [
                    cross.recv([f.theirs[k - 1]], (rank - k) % n, f.tag) for k in range(1, n)
                ]

    def add(self) -> None:
        """The next part (in the order laid out) is final on this member: on the wire."""
        f = self.flights[self.added]
        if self.tiers.local is not None:
            f.local = self.tiers.local.allreduce([f.t], _opts(f.op))
        self.added += 1
        self.poll()

    def poll(self) -> None:
        """Send each part, in order, whose local stage is done (a leader's)."""
        if self.tiers.cross is None:
            return
        while self.crossed < self.added and self.flights[self.crossed].ready_to_cross():
            self._cross(self.flights[self.crossed])
            self.crossed += 1

    def finish(self) -> None:
        """Every part reduced over every member, in place; raises on a timeout or on an
        aborted group (an abandoned step)."""
        if self.added != len(self.flights):
            raise RuntimeError(f"tiered parts: {self.added} of {len(self.flights)} added")
        for i, f in enumerate(self.flights):  # every part on the wire before any fold
            if f.local is not None:  # done before the part crosses or is overwritten
                f.local.wait(self.timeout)
            if self.tiers.cross is not None and i >= self.crossed:
                self._cross(f)
                self.crossed = i + 1
        casts = []
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        for f in self.flights:
            if self.tiers.cross is not None:
                self._fold(f)
            if self.tiers.local is not None:
                casts.append(self.tiers.local.broadcast([f.t], opts))
        for w in casts:
            w.wait(self.timeout)

    def _cross(self, f: _Flight) -> None:
        cross = self.tiers.cross
        if not self.direct:
            f.cross = [cross.allreduce([f.t], _opts(f.op))]
            return
        rank, n = cross.rank(), cross.size()
        f.cross = [cross.send([f.t], (rank + k) % n, f.tag) for k in range(1, n)]

    def _fold(self, f: _Flight) -> None:
        """Wait for the part's exchange (its sends too: they read ``t``) and fold it in."""
        for w in f.cross + f.recvs:
            w.wait(self.timeout)
        for other in f.theirs:
            if f.op == dist.ReduceOp.SUM:
                f.t += other
            else:
                torch.maximum(f.t, other, out=f.t)
        f.theirs = []


def _opts(op: Any) -> dist.AllreduceOptions:
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    return opts
