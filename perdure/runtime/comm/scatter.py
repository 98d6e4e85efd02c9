"""The exact reduction's integer sum, reduce-scattered inside replica groups (HSDP).

With ``train.shard_degree = k`` each rank of a replica group updates only the parameters
its shard owns, so it needs the step's gradient sum on those alone. Given each shard one
contiguous value range of the slot buffer's gradient part (``shard_plan.contiguous_owners``
over the buffer's order), the integer accumulator that every rank already builds (its own
slots, against the step's shared block exponents) is summed in two tiers:

1. a reduce-scatter inside the group: rank ``j`` receives the group's sum of range ``j``
   (per rank (k - 1)/k of the buffer on the wire, half an all-reduce's);
2. an all-reduce of that range among the ranks that own the same shard in every group
   (1/k of the buffer, across groups).

The rest of the buffer (buffer moves, non-finite flags and slot losses: a few values) is
all-reduced whole over every member, as every rank needs it. Integer addition is
associative, so this grouping gives the bits of the flat all-reduce for every k and group
count: ``shard_reduce`` is not part of the math.

The exchange goes in the reduction's buckets, each sent as soon as it is converted, so
that gloo's threads move one while this thread converts the next (as the flat path
overlaps its all-reduces).

Once a bucket's exchange in the group is done, the pages of its other shards' values are
handed back to the kernel (``comm/pages.py``: the buffer keeps its size, the memory goes),
and :meth:`ScatterExchange.settle` lets a streaming reduction keep only the newest buckets
in flight, so that a rank's gradient side stays near ``P / k`` plus two buckets, as FSDP2's.

Limits: only the own range and the tail hold the sum (the rest reads as zeros or the local
partial); and across regions
the second tier is the backend's flat all-reduce (the two-tier region reduction,
``tiers.py``, carries the exponents and the tail only).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

import torch
import torch.distributed as dist

from perdure.runtime.comm.pages import release
from perdure.runtime.comm.tiers import Tiers, tiered_allreduce


@dataclass(frozen=True)
class Scatter:
    """One member's reduce-scatter for one membership epoch."""

    group: Any
    """The process group of this rank's replica group (k ranks), for the scatter alone."""
    cross: Any | None
    """The ranks that own this rank's shard, one per group (None with one group)."""
    ranges: tuple[tuple[int, int], ...]
    """Each shard's value range ``[lo, hi)`` of the gradient part, by shard."""
    shard: int
    """This rank's shard (its position in its group)."""
    numel: int
    """P: the gradient part's length; the buffer's tail after it is reduced whole."""
    size: int
    """The slot buffer's length: other buffers (a rerun's flags) take the flat path."""
    in_group: Literal["reduce_scatter", "all_reduce"] = "reduce_scatter"
    """The first tier's collective: ``reduce_scatter`` (NCCL's own), or ``all_reduce`` of
    each bucket inside the group, of which a rank keeps its part (gloo, whose
    ``reduce_scatter`` measured 1.0-2.1x its ``all_reduce`` of the same buffer here:
    ``docs/performance.md`` section 12c). The same bits either way."""

    def __post_init__(self) -> None:
        assert self.ranges[0][0] == 0 and self.ranges[-1][1] == self.numel, self.ranges
        assert all(a[1] == b[0] for a, b in zip(self.ranges, self.ranges[1:], strict=False))

    @property
    def mine(self) -> tuple[int, int]:
        return self.ranges[self.shard]

    def spans(self) -> list[tuple[int, int]]:
        """The value ranges that hold the sum after the exchange."""
        out = [self.mine] if self.mine[0] < self.mine[1] else []
        return out + ([(self.numel, self.size)] if self.size > self.numel else [])


class ScatterExchange:
    """One step's reduce-scatter, a bucket at a time: :meth:`send` each bucket of the
    accumulator once it is final (gloo's threads reduce it while the caller converts the
    next), then :meth:`finish` yields this rank's parts in order once their sums are in
    ``acc``. Every rank sends the same buckets in the same order (a bucket whose part is
    empty on some ranks too: the collectives of a group must match)."""

    def __init__(
        self,
        sc: Scatter,
        acc: torch.Tensor,
        pg: Any,
        tiers: Tiers | None,
        fold: Callable[[int, int, torch.Tensor], None] | None = None,
    ) -> None:
        """``fold(x, y, part)``: one round of several (``train.shard_reduce_slots =
        "each"``, ``streamed.Rounds``): each bucket's group sum of this rank's range
        ``[x, y)`` is handed to ``fold`` once settled, and then the whole bucket's pages
        are dropped (its own part too: the rank's accumulator holds it); such an exchange
        is only settled, never finished."""
        assert acc.numel() == sc.size and not acc.is_floating_point()
        self.sc, self.acc, self.pg, self.tiers, self.fold = sc, acc, pg, tiers, fold
        lo, hi = sc.mine
        n = 0 if sc.in_group == "all_reduce" else hi - lo
        self.got = torch.empty(n, dtype=acc.dtype, device=acc.device)
        self.pending: list[tuple[Any, tuple[int, int]]] = []
        self.buckets: list[tuple[int, int]] = []
        """Each pending exchange's bucket ``[a, b)`` of the gradient part."""
        self.settled = 0
        """How many of ``pending`` are done and their foreign values' pages dropped."""

    def send(self, a: int, b: int) -> None:
        """Bucket ``[a, b)`` of the accumulator is final here: reduce-scatter its part of
        the gradient (the tail after it goes whole in :meth:`finish`)."""
        sc, b = self.sc, min(b, self.sc.numel)
        if a >= b:
            return
        cut = [(max(a, lo), max(max(a, lo), min(b, hi))) for lo, hi in sc.ranges]
        x, y = cut[sc.shard]
        self.buckets.append((a, b))
        if sc.in_group == "all_reduce":
            self.pending.append((sc.group.allreduce([self.acc[a:b]]), (x, y)))
            return
        inputs = [self.acc[x:y] for x, y in cut]
        out = self.got[x - sc.mine[0] : y - sc.mine[0]]
        work = sc.group.reduce_scatter([out], [inputs], dist.ReduceScatterOptions())
        self.pending.append((work, (x, y)))

    def settle(self, keep: int, timeout: timedelta) -> int:
        """Wait for all but the ``keep`` newest exchanges in the group and drop the pages
        of their other shards' values (dead once sent: ``comm/pages.py``); returns the end
        of the gradient values settled so far (0: none)."""
        while len(self.pending) - self.settled > keep:
            self._settle_next(timeout)
        return self.buckets[self.settled - 1][1] if self.settled else 0

    def _settle_next(self, timeout: timedelta) -> None:
        work, (x, y) = self.pending[self.settled]
        work.wait(timeout)
        a, b = self.buckets[self.settled]
        x, y = min(max(x, a), b), min(max(y, a), b)  # a shard's cut of another bucket: empty
        if self.fold is not None:
            if x < y:
                lo = self.sc.mine[0]
                inplace = self.sc.in_group == "all_reduce"
                own = self.acc[x:y] if inplace else self.got[x - lo : y - lo]
                self.fold(x, y, own)
            release(self.acc[a:b])
        elif x == y:
            release(self.acc[a:b])
        else:
            release(self.acc[a:x])
            release(self.acc[y:b])
        self.settled += 1

    def crossed(
        self, buckets: Iterable[tuple[int, int]], timeout: timedelta
    ) -> Iterator[tuple[int, int]]:
        """After every round (``fold``; nothing pending): this rank's range, put back in
        ``acc`` whole, all-reduced across groups and the tail over every member; yields
        them as :meth:`finish` does. The cross-group calls are :meth:`finish`'s, one per
        ``buckets`` range that meets this rank's range (``[a, b)``, in order): another
        group may reduce once, and the collectives across groups must match."""
        assert self.settled == len(self.pending), "rounds pending"
        sc, cross = self.sc, self.sc.cross
        lo, hi = sc.mine
        tail = self.acc[sc.numel :]
        tail_work = self.pg.allreduce([tail]) if tail.numel() else None
        works = []
        for a, b in buckets:
            x, y = max(a, lo), min(b, hi, sc.numel)
            if x < y and cross is not None:
                works.append(cross.allreduce([self.acc[x:y]]))
        for work in works:
            work.wait(timeout)
        if lo < hi:
            yield lo, hi
        if tail_work is not None:
            tail_work.wait(timeout)
            yield sc.numel, sc.size

    def finish(self, timeout: timedelta) -> Iterator[tuple[int, int]]:
        """The value ranges whose sums over every member are in ``acc``, in order: this
        rank's parts as their cross-group all-reduce completes, then the tail."""
        sc, tail, cross = self.sc, self.acc[self.sc.numel :], self.sc.cross
        crosses = []
        inplace = sc.in_group == "all_reduce"
        for i, (_, (x, y)) in enumerate(self.pending):
            if i == self.settled:  # each bucket's cross-group step starts once it is in
                self._settle_next(timeout)
            part = self.acc[x:y] if inplace else self.got[x - sc.mine[0] : y - sc.mine[0]]
            done = None if x == y or cross is None else cross.allreduce([part])
            crosses.append((done, (x, y), part))
        tail_work = self.pg.allreduce([tail]) if tail.numel() and self.tiers is None else None
        for work, (x, y), part in crosses:
            if work is not None:
                work.wait(timeout)
            if x < y:
                if not inplace:
                    self.acc[x:y] = part
                yield x, y
        if tail_work is not None:
            tail_work.wait(timeout)
        elif tail.numel() and self.tiers is not None:
            tiered_allreduce(self.tiers, tail, dist.ReduceOp.SUM, timeout)
        if tail.numel():
            yield sc.numel, sc.size
