"""Step-time models: compute, plus each reduction's cost on a topology of regions.

Pure functions of (bytes, members per region, links). The reduction costs follow the
alpha-beta model: a bandwidth term (bytes over the slowest link a flow crosses) plus the
latencies on the critical path of a chunk. For a ring all_reduce over k workers that
spans r regions, a chunk travels 2(k-1) hops, of which a fraction r/k cross a region
boundary; the bandwidth term is the classic 2(k-1)/k x bytes / bw. The chain (perdure's
left fold) moves the same bytes (its measured time over ``all_reduce``'s,
``chain_over_ring``, scales that term), crosses a boundary 2(r-1) times, and pays a
pipeline fill of 2(k-1) chunk hops. The exact reduction is the backend's ring all_reduce
of its integer payload (int32: the bytes of fp32; int64: twice) plus one small MAX
all_reduce of the block exponents, either flat or hierarchical: a reduce-scatter inside
each region, one exchange of the shards across regions (every owner sends its shard to
its r-1 counterparts; each region pair carries the payload once per direction, one
latency) and an all-gather inside each region.

Limits: links are uniform inside a region and between any two regions; no congestion
from other jobs; the chain's measured ratio is a CPU/loopback number applied to any
network; the integer conversion's compute is not counted (the exact reduction is not
measured yet); the optimizer step is not counted.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

CHUNK_BYTES = 4 * 2**20
"""The chain's chunk: perdure's default ``CHUNK_ELEMS`` (1 Mi float32 values)."""
BACKWARD_SHARE = 2 / 3
"""Backward's share of a training step's FLOPs (6 P per token: 2 forward, 4 backward):
the window a reduction can hide behind."""


@dataclass(frozen=True)
class Links:
    """Bandwidths in bytes/s, latencies in s (one way)."""

    intra_bps: float
    intra_lat_s: float
    cross_bps: float
    cross_lat_s: float

    def slower(self, extra_lat_s: float) -> Links:
        """The same links with extra cross-region latency (a spike)."""
        return Links(
            self.intra_bps, self.intra_lat_s, self.cross_bps, self.cross_lat_s + extra_lat_s
        )


def _spread(members: tuple[int, ...]) -> tuple[int, int]:
    """(workers, regions with any)."""
    return sum(members), sum(1 for m in members if m > 0)


def ring_s(nbytes: float, members: tuple[int, ...], links: Links) -> float:
    """Ring all_reduce of ``nbytes`` over the members (regions kept contiguous)."""
    k, r = _spread(members)
    if k <= 1:
        return 0.0
    bw = links.intra_bps if r <= 1 else min(links.intra_bps, links.cross_bps)
    cross = r / k if r > 1 else 0.0
    lat = 2 * (k - 1) * (cross * links.cross_lat_s + (1 - cross) * links.intra_lat_s)
    return 2 * (k - 1) / k * nbytes / bw + lat


def chain_s(nbytes: float, members: tuple[int, ...], links: Links, chain_over_ring: float) -> float:
    """perdure's chain: up the ranks and back down, chunks pipelining the hops."""
    k, r = _spread(members)
    if k <= 1:
        return 0.0
    bw = links.intra_bps if r <= 1 else min(links.intra_bps, links.cross_bps)
    band = 2 * (k - 1) / k * nbytes / bw * chain_over_ring
    lat = 2 * ((r - 1) * links.cross_lat_s + (k - r) * links.intra_lat_s)
    fill = 2 * (k - 1) * min(CHUNK_BYTES, nbytes) / bw
    return band + lat + fill


def hier_s(nbytes: float, members: tuple[int, ...], links: Links) -> float:
    """Reduce-scatter inside each region, one exchange across regions, all-gather inside."""
    _k, r = _spread(members)
    if r <= 1:
        return ring_s(nbytes, members, links)
    n = min(m for m in members if m > 0)  # the region with the fewest members is slowest
    intra = 2 * (n - 1) / n * nbytes / links.intra_bps + 2 * (n - 1) * links.intra_lat_s
    exchange = max(nbytes / links.cross_bps, (r - 1) * nbytes / (n * links.intra_bps))
    return intra + exchange + links.cross_lat_s


def exact_s(
    params: float, members: tuple[int, ...], links: Links, *, hier: bool, int_bytes: int, block: int
) -> float:
    """The exact reduction: integer payload plus a MAX all_reduce of block exponents."""
    algo = hier_s if hier else ring_s
    return algo(params * int_bytes, members, links) + algo(params / block * 4, members, links)


@dataclass(frozen=True)
class ComputeModel:
    """FLOP-based compute of one step."""

    params: float
    tokens_per_step: float
    slots: int
    worker_flops: float
    workers: int
    """The full membership (W): DDP's per-worker batch is B/W whoever is missing."""

    @property
    def slot_s(self) -> float:
        return 6 * self.params * self.tokens_per_step / self.slots / self.worker_flops

    def perdure_s(self, k: int) -> float:
        """With k members, the busiest computes ceil(S/k) slots (a fixed global batch)."""
        return math.ceil(self.slots / max(k, 1)) * self.slot_s

    def ddp_s(self) -> float:
        """A DDP replica computes its fixed share B/W (fewer replicas: a smaller batch)."""
        return 6 * self.params * self.tokens_per_step / self.workers / self.worker_flops


@dataclass(frozen=True)
class AnalyticStep:
    """Step time of a deployment: compute plus the reduction's exposed part."""

    compute: ComputeModel
    links: Links
    reduction: str
    """``chain``, ``exact_flat``, ``exact_hier`` (perdure) or ``ddp`` (a peer's ring)."""
    grad_bytes: int
    int_bytes: int
    block: int
    chain_over_ring: float
    overhead: float
    """perdure's measured runtime overhead on its compute (1 for the peers)."""
    _memo: dict[tuple[tuple[int, ...], float], float] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """Step times already computed (the loop asks for the same few states again and
    again; hashing the whole model for an lru_cache each time cost more than the maths)."""

    def reduce_s(self, members: tuple[int, ...], extra_lat_s: float = 0.0) -> float:
        return _reduce_s(self, members, extra_lat_s)

    def seconds(
        self, members: tuple[int, ...], extra_lat_s: float = 0.0, starting: int = 0
    ) -> float:
        """``starting`` (processes starting up) costs nothing here: own devices."""
        key = (members, extra_lat_s)
        t = self._memo.get(key)
        if t is None:
            t = self._memo[key] = _seconds(self, members, extra_lat_s)
        return t

    @property
    def slot_s(self) -> float:
        return self.compute.slot_s * self.overhead

    @property
    def ideal_s(self) -> float:
        """The step's compute alone at full strength: the common yardstick."""
        return self.compute.ddp_s()

    def small_allreduce_s(self, members: tuple[int, ...]) -> float:
        """A few bytes all-reduced: latency only (the NaN verdicts)."""
        algo = hier_s if self.reduction == "exact_hier" else ring_s
        return algo(64.0, members, self.links)


def _reduce_s(m: AnalyticStep, members: tuple[int, ...], extra_lat_s: float) -> float:
    links = m.links.slower(extra_lat_s)
    p = m.compute.params
    if m.reduction == "chain":
        return chain_s(p * m.grad_bytes, members, links, m.chain_over_ring)
    if m.reduction in ("exact_flat", "exact_hier"):
        hier = m.reduction == "exact_hier"
        return exact_s(p, members, links, hier=hier, int_bytes=m.int_bytes, block=m.block)
    return ring_s(p * m.grad_bytes, members, links)


def _seconds(m: AnalyticStep, members: tuple[int, ...], extra_lat_s: float) -> float:
    k = sum(members)
    if m.reduction == "ddp":
        compute = m.compute.ddp_s()
        window = BACKWARD_SHARE * compute  # DDP's buckets overlap the whole backward
    else:
        compute = m.compute.perdure_s(k) * m.overhead
        window = BACKWARD_SHARE * m.compute.slot_s  # only the last slot's backward
    exposed = max(0.0, _reduce_s(m, members, extra_lat_s) - window)
    return compute + exposed


@dataclass(frozen=True)
class HostStep:
    """Step time on a time-shared CPU host (the benchmarks here): a measured step time at
    the full membership, scaled by the measured step-time-vs-workers curve of this host.
    A process starting on the host (``starting``) takes a share of the cores like a
    member does. ``delay_hops``: sends per step of a delayed worker on the critical path
    (the chain delays a worker's first send of each reduction)."""

    step_s: float
    workers: int
    curve: tuple[tuple[int, float], ...]
    slots: int
    cores: int
    delay_hops: int = 1

    def seconds(
        self, members: tuple[int, ...], extra_lat_s: float = 0.0, starting: int = 0
    ) -> float:
        k = max(sum(members) + starting, 1)
        ratio = interp(self.curve, k) / interp(self.curve, self.workers)
        return self.step_s * ratio + self.delay_hops * extra_lat_s

    @property
    def ideal_s(self) -> float:
        return self.step_s

    @property
    def slot_s(self) -> float:
        """One slot computed alone: a step's CPU time spread over S slots."""
        return self.step_s * min(self.workers, self.cores) / self.slots

    def small_allreduce_s(self, members: tuple[int, ...]) -> float:
        return 0.0


def interp(curve: tuple[tuple[int, float], ...], x: float) -> float:
    """Piecewise-linear through measured (x, y) points, clamped at the ends."""
    pts = sorted(curve)
    if x <= pts[0][0]:
        return pts[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(pts):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return pts[-1][1]


StepModel = AnalyticStep | HostStep
