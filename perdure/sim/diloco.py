"""DiLoCo's step on a deployment: inner steps inside each region, an outer step across.

R virtual replicas (``policies.diloco.replicas``) are placed on the regions, replica i
at home in region ``i mod r``; a region's workers compute its replicas' inner steps one
after the other, each the synchronous perdure step of one replica's batch (``B / R``
tokens in ``S / R`` slots: ``ceil(S / R / k)`` slot times on k members) with perdure's
exact reduction over the region's workers only: intra-region links, no cross-region
latency. Regions do not wait for each other between outer steps, so H inner steps take H
times the slowest region's inner step. Then the outer step: every region's replicas'
pseudo-gradients (outer parameters minus the replica's, replicated on each of its
workers) are summed across regions: each worker sends its ``1/n`` shard to its
counterparts in the r-1 other regions (each region pair carries a payload once per
direction), sums what it receives, and the sums are all-gathered inside the region.

- **Bytes a value** on the cross-region wire: ``fp32`` goes through the exact reduction
  the synchronous step uses (its ``int_bytes`` integer and a 4-byte block maximum per
  ``block`` values: a MAX round, then the payload), so an outer step moves exactly the
  bytes of one synchronous step; ``int8``: one byte a value and a one-byte power-of-two
  exponent per block (a MAX round of the exponents, then the values), a quarter of the
  int32 form's. Per token: ``1/H`` (fp32) and ``1/(4H)`` (int8) of the synchronous
  step's, for the same hierarchical exchange.
- **Overlap** (``overlap = true``: the outer update applied one outer step late, as
  streaming DiLoCo's delayed update): the exchange runs behind the next H inner steps
  and is exposed only by what it lasts beyond them, ``max(0, outer - H x inner)``.
- **Placement** (:meth:`DilocoStep.placement`): a region without members hosts nothing;
  its replicas go, one by one, to the region with the most members per replica once it
  hosts one more (ties: the first), which then computes their inner steps after its own.

Limits: the model's statistical efficiency is not simulated (DiLoCo's loss per token
differs from the synchronous step's: the tokens/s here are throughput, not quality); the
overlapped exchange's intra-region part is taken not to slow the inner steps' own
reductions (they share the NICs); a region hosting several replicas sends one payload
(their sum: exact for the integers, a few bits more than int8 for int8, not counted);
the outer optimizer's step and the outer state's memory (two fp32 copies of the
parameters) are not counted. The exchange is modelled on a link per region pair, where
the runtime's two ways of combining the regions' leaders (``cluster.cross_region_reduce``:
the direct exchange, or the ring that is its default for the outer step, half the bytes
at four regions) take the same time; on a shared uplink per region, as in
``benchmarks/bench_diloco.py``, the ring is faster (docs/performance.md, 18d).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from perdure.sim.steptime import (
    STEP_PARTS,
    AnalyticStep,
    Links,
    Parts,
    exact_value_bytes,
    step_parts,
)

Precision = Literal["fp32", "int8"]


def home_replicas(replicas: int, regions: int) -> tuple[int, ...]:
    """Replicas at home in each region: replica i in region ``i mod regions``."""
    return tuple(len(range(j, replicas, regions)) for j in range(regions))


def outer_parts(nbytes: float, members: tuple[int, ...], links: Links) -> Parts:
    """One phase of the outer exchange of an ``nbytes`` payload replicated on every
    worker of each region with members: the shards across regions, then an all-gather
    of the sums inside each region (the region with the fewest members is slowest)."""
    live = [m for m in members if m > 0]
    r = len(live)
    if r <= 1:
        return Parts(0.0, 0.0)
    n = min(live)
    exchange = max(nbytes / links.cross_bps, (r - 1) * nbytes / (n * links.intra_bps))
    gather = (n - 1) / n * nbytes / links.intra_bps
    return Parts(exchange + gather, links.cross_lat_s + (n - 1) * links.intra_lat_s)


@dataclass(frozen=True)
class DilocoStep:
    """The step model of the ``diloco`` policy (the module docstring derives it). A
    step of the engine is one inner step of every replica (the global batch, as a
    synchronous step); the outer step is amortised over ``inner_steps`` of them."""

    replica: AnalyticStep
    """One replica's inner step on one region's members (``B / R`` tokens, ``S / R``
    slots, perdure's reduction over intra-region links)."""
    links: Links
    home: tuple[int, ...]
    """Replicas at home in each region (:func:`home_replicas`)."""
    inner_steps: int
    """H."""
    precision: Precision
    int_bytes: int
    """The exact reduction's integer (``fp32`` pseudo-gradients go through it)."""
    block: int
    """Values per block maximum (exponent)."""
    values: float
    """Pseudo-gradient values each GPU exchanges (its share of the replica)."""
    overlap: bool
    """The outer update applied one outer step late: the exchange behind the next H
    inner steps."""
    ideal: float
    """The global step's compute alone (the yardstick of every policy)."""
    _memo: dict[tuple[tuple[int, ...], float], float] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )

    @property
    def ideal_s(self) -> float:
        return self.ideal

    @property
    def slot_s(self) -> float:
        return self.replica.slot_s

    @property
    def replicas(self) -> int:
        return sum(self.home)

    def value_bytes(self) -> tuple[float, float]:
        """(block maxima, payload) bytes a value on the cross-region wire."""
        if self.precision == "int8":
            return 1 / self.block, 1.0
        return 4 / self.block, float(self.int_bytes)

    def wire_value_bytes(self) -> float:
        """Bytes a value of one outer step's payload: fp32 the synchronous exact
        reduction's (:func:`~perdure.sim.steptime.exact_value_bytes`), int8 a quarter."""
        if self.precision == "fp32":
            return exact_value_bytes(self.int_bytes, self.block)
        return sum(self.value_bytes())

    def placement(self, members: tuple[int, ...]) -> tuple[int, ...]:
        """Replicas hosted by each region with these members (the module docstring)."""
        hosted = [h if m > 0 else 0 for h, m in zip(self.home, members, strict=True)]
        orphans = sum(self.home) - sum(hosted)
        live = [j for j, m in enumerate(members) if m > 0]
        for _ in range(orphans if live else 0):
            j = max(live, key=lambda i: (members[i] / (hosted[i] + 1), -i))
            hosted[j] += 1
        return tuple(hosted)

    def replica_s(self, k: int) -> float:
        """One replica's inner step on a region of ``k`` members."""
        return self.replica.seconds((k,))

    def inner_s(self, members: tuple[int, ...]) -> float:
        """One inner step of every replica: the slowest region's replicas in turn."""
        hosted = self.placement(members)
        return max(
            (h * self.replica_s(k) for h, k in zip(hosted, members, strict=True) if h),
            default=float("inf"),
        )

    def outer_s(self, members: tuple[int, ...], extra_lat_s: float = 0.0) -> float:
        """The outer exchange: the MAX round of the block exponents, then the payload."""
        links = self.links.slower(extra_lat_s)
        maxima, payload = self.value_bytes()
        parts = outer_parts(self.values * maxima, members, links)
        return (parts + outer_parts(self.values * payload, members, links)).total

    def exposed_outer_s(self, members: tuple[int, ...], extra_lat_s: float = 0.0) -> float:
        """What an outer step adds to H inner steps."""
        outer = self.outer_s(members, extra_lat_s)
        if not self.overlap:
            return outer
        return max(0.0, outer - self.inner_steps * self.inner_s(members))

    def seconds(
        self, members: tuple[int, ...], extra_lat_s: float = 0.0, starting: int = 0
    ) -> float:
        """An inner step of every replica plus 1/H of the exposed outer step."""
        key = (members, extra_lat_s)
        t = self._memo.get(key)
        if t is None:
            inner = self.inner_s(members)
            t = inner + self.exposed_outer_s(members, extra_lat_s) / self.inner_steps
            self._memo[key] = t
        return t

    def small_allreduce_s(self, members: tuple[int, ...]) -> float:
        """A few bytes all-reduced inside the largest region (the NaN verdicts: a shard
        belongs to one region's replica)."""
        return self.replica.small_allreduce_s((max(members),))

    def recompute_s(self, before: tuple[int, ...], after: tuple[int, ...], u: float) -> float:
        """Replicas moved by the change from ``before`` to ``after`` recompute ``u`` inner
        steps each on their new hosts (in parallel across hosts, in turn on one)."""
        was, now = self.placement(before), self.placement(after)
        moved = [max(0, n - w) for w, n in zip(was, now, strict=True)]
        return max(
            (m * u * self.replica_s(k) for m, k in zip(moved, after, strict=True) if m),
            default=0.0,
        )

    def cross_region_bytes(self, members: tuple[int, ...], params: float) -> float:
        """Bytes crossing a region boundary per engine step (an outer step's over H):
        each region's payload to each of the r-1 others."""
        r = sum(1 for h in self.placement(members) if h)
        payload = params * self.wire_value_bytes()
        return r * (r - 1) * payload / self.inner_steps

    def parts(self, members: tuple[int, ...]) -> dict[str, float]:
        """The step by dimension (:data:`~perdure.sim.steptime.STEP_PARTS`) in the
        slowest region, times the replicas it hosts; ``reduction`` also holds the outer
        step's exposed part over H."""
        hosted = self.placement(members)
        j = max(
            (i for i, h in enumerate(hosted) if h),
            key=lambda i: hosted[i] * self.replica_s(members[i]),
        )
        inner = step_parts(self.replica, (members[j],))
        parts = {p: hosted[j] * inner.get(p, 0.0) for p in STEP_PARTS}
        parts["reduction"] += self.exposed_outer_s(members) / self.inner_steps
        return parts
