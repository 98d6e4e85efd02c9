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

**Overlap** (:func:`bucketed_exposed`): a reduction cut into ``n`` equal buckets that the
backward finishes one after another over a window ``w`` (DDP's buckets behind its whole
backward; perdure's streamed buckets behind its last slot's backward), the buckets'
bandwidth terms queued on the links and their latencies overlapping (every bucket in
flight at once), ends ``max(c, B - w (1 - 1/n)) + L`` after the window, with ``B`` the
whole bandwidth term, ``c = B / n`` one bucket's and ``L`` one collective's latency: the
last bucket is finished by the backward's end, so its latency is never hidden. The
pre-streaming model (``last_slot``: the whole reduction once the last slot is done, hidden
behind that slot's backward only as far as it goes) is kept to compare.

Limits: links are uniform inside a region and between any two regions; no congestion
from other jobs; the chain's measured ratio is a CPU/loopback number applied to any
network; the integer conversion's compute is not counted apart (the measured streamed
ratio carries it); the optimizer step is not counted; in-flight buckets' latencies are
taken to overlap (NCCL queues one communicator's collectives on one stream, so this
favours every bucketed reduction, DDP's as much as perdure's).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Protocol

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


@dataclass(frozen=True)
class Parts:
    """A collective's cost: its bandwidth term and its latency term, seconds."""

    bw: float
    lat: float

    @property
    def total(self) -> float:
        return self.bw + self.lat

    def __add__(self, other: Parts) -> Parts:
        return Parts(self.bw + other.bw, self.lat + other.lat)


def ring_parts(nbytes: float, members: tuple[int, ...], links: Links) -> Parts:
    """Ring all_reduce of ``nbytes`` over the members (regions kept contiguous)."""
    k, r = _spread(members)
    if k <= 1:
        return Parts(0.0, 0.0)
    bw = links.intra_bps if r <= 1 else min(links.intra_bps, links.cross_bps)
    cross = r / k if r > 1 else 0.0
    lat = 2 * (k - 1) * (cross * links.cross_lat_s + (1 - cross) * links.intra_lat_s)
    return Parts(2 * (k - 1) / k * nbytes / bw, lat)


def ring_s(nbytes: float, members: tuple[int, ...], links: Links) -> float:
    return ring_parts(nbytes, members, links).total


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


def hier_parts(nbytes: float, members: tuple[int, ...], links: Links) -> Parts:
    """Reduce-scatter inside each region, one exchange across regions, all-gather inside."""
    _k, r = _spread(members)
    if r <= 1:
        return ring_parts(nbytes, members, links)
    n = min(m for m in members if m > 0)  # the region with the fewest members is slowest
    intra = 2 * (n - 1) / n * nbytes / links.intra_bps
    exchange = max(nbytes / links.cross_bps, (r - 1) * nbytes / (n * links.intra_bps))
    return Parts(intra + exchange, 2 * (n - 1) * links.intra_lat_s + links.cross_lat_s)


def hier_s(nbytes: float, members: tuple[int, ...], links: Links) -> float:
    return hier_parts(nbytes, members, links).total


def exact_s(
    params: float, members: tuple[int, ...], links: Links, *, hier: bool, int_bytes: int, block: int
) -> float:
    """The exact reduction with step exponents: a MAX all_reduce of the block exponents,
    then the integer payload (two collectives one after the other)."""
    algo = hier_s if hier else ring_s
    return algo(params * int_bytes, members, links) + algo(params / block * 4, members, links)


def bucketed_exposed(whole: Parts, window_s: float, buckets: int) -> float:
    """Seconds a bucketed reduction runs past the end of the backward that produces its
    buckets evenly over ``window_s`` (the module docstring derives it)."""
    n = max(1, buckets)
    c = whole.bw / n
    return max(c, whole.bw - window_s * (1 - 1 / n)) + whole.lat


@dataclass(frozen=True)
class ComputeModel:
    """FLOP-based compute of one step for W replicas of ``gpus`` accelerators each.

    A slot is one micro-batch of a replica: its FLOPs over the replica's GPUs, plus the
    exposed part of the communication inside the replica (``slot_comm_s``: tensor
    parallel all-reduces, FSDP gathers not hidden by prefetch; see
    :mod:`perdure.sim.sharding`). With ``pp`` pipeline stages and ``v`` virtual stages a
    GPU, a step of ``m`` micro-batches takes ``m + (pp - 1) / v`` slot times (interleaved
    1F1B's bubble: ``bubble``)."""

    params: float
    tokens_per_step: float
    slots: int
    worker_flops: float
    """FLOP/s of one replica (its GPUs together)."""
    workers: int
    """The full membership (W): DDP's per-worker batch is B/W whoever is missing."""
    bubble: float = 0.0
    """Slot times a step's pipeline bubble adds: ``(pp - 1) / v``."""
    slot_comm_s: float = 0.0
    reduce_params: float | None = None
    """Gradient values each GPU reduces across replicas (P / (tp pp shard)); unset: P."""

    @property
    def flops_slot_s(self) -> float:
        return 6 * self.params * self.tokens_per_step / self.slots / self.worker_flops

    @property
    def slot_s(self) -> float:
        return self.flops_slot_s + self.slot_comm_s

    @property
    def grad_values(self) -> float:
        return self.params if self.reduce_params is None else self.reduce_params

    def perdure_s(self, k: int) -> float:
        """With k members, the busiest computes ceil(S/k) slots (a fixed global batch)."""
        return (math.ceil(self.slots / max(k, 1)) + self.bubble) * self.slot_s

    def ddp_s(self) -> float:
        """A DDP replica computes its fixed share B/W (fewer replicas: a smaller batch)."""
        return (self.slots / self.workers + self.bubble) * self.slot_s

    @property
    def ideal_s(self) -> float:
        """The step's FLOPs alone over every GPU: no bubble, no communication."""
        return 6 * self.params * self.tokens_per_step / self.workers / self.worker_flops


OVERLAPS = ("streamed", "bucketed", "last_slot")
"""perdure's overlap models: ``streamed`` (what the runtime does: the last slot's buckets
behind its backward on a flat group; across regions the two-tier exchange goes after the
last slot, not bucketed), ``bucketed`` (every reduction bucketed, the two-tier exchange
too: not built), ``last_slot`` (the pre-streaming step: step exponents, the whole
reduction once the last slot is done)."""
DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's default ``bucket_cap_mb``."""
STREAM_BUCKET_VALUES = 1 << 20
"""perdure's streamed bucket (``runtime/comm/exact.py``: ``CHUNK`` values)."""


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
    overhead: float = 1.0
    """perdure's measured runtime overhead on its compute (``last_slot`` and the chain;
    1 for the peers)."""
    overlap: str = "streamed"
    """One of :data:`OVERLAPS` (perdure's exact reductions; the chain keeps ``last_slot``)."""
    step_overhead: float = 1.0
    """perdure's measured step over DDP's at the same micro-batching on a wire-bound link
    (the streamed reduction), applied to the whole step."""
    streamed_bytes: float = 1.0
    """The streamed reduction's bytes on the wire over DDP's fp32 (measured)."""
    _memo: dict[tuple[tuple[int, ...], float], float] = field(
        default_factory=dict, init=False, compare=False, repr=False
    )
    """Step times already computed (the loop asks for the same few states again and
    again; hashing the whole model for an lru_cache each time cost more than the maths)."""

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
    def streams(self) -> bool:
        return self.reduction in ("exact_flat", "exact_hier") and self.overlap != "last_slot"

    @property
    def slot_s(self) -> float:
        return self.compute.slot_s * self.overhead * self.step_overhead

    @property
    def ideal_s(self) -> float:
        """The step's compute alone at full strength: the common yardstick."""
        return self.compute.ideal_s

    def small_allreduce_s(self, members: tuple[int, ...]) -> float:
        """A few bytes all-reduced: latency only (the NaN verdicts)."""
        algo = hier_s if self.reduction == "exact_hier" else ring_s
        return algo(64.0, members, self.links)

    def exposed_s(self, members: tuple[int, ...], extra_lat_s: float = 0.0) -> float:
        """The reduction's time past the end of the backward."""
        return _exposed(self, members, self.links.slower(extra_lat_s))


def _exposed(m: AnalyticStep, members: tuple[int, ...], links: Links) -> float:
    p, c = m.compute.grad_values, m.compute
    if m.reduction == "ddp":
        nbytes = p * m.grad_bytes
        window = BACKWARD_SHARE * (c.ddp_s() if c.bubble == 0 else c.slot_s)
        buckets = math.ceil(nbytes / DDP_BUCKET_BYTES)
        return bucketed_exposed(ring_parts(nbytes, members, links), window, buckets)
    last_slot = BACKWARD_SHARE * c.slot_s
    if not m.streams:
        if m.reduction == "chain":
            whole = chain_s(p * m.grad_bytes, members, links, m.chain_over_ring)
        else:
            hier = m.reduction == "exact_hier"
            whole = exact_s(p, members, links, hier=hier, int_bytes=m.int_bytes, block=m.block)
        return max(0.0, whole - last_slot)
    nbytes = p * m.int_bytes * m.streamed_bytes
    buckets = math.ceil(p / STREAM_BUCKET_VALUES)
    if m.reduction == "exact_flat" or _spread(members)[1] <= 1:  # one region: no tiers
        return bucketed_exposed(ring_parts(nbytes, members, links), last_slot, buckets)
    if m.overlap == "bucketed":
        return bucketed_exposed(hier_parts(nbytes, members, links), last_slot, buckets)
    # the runtime's two-tier path: the MAX of the maxima, then one exchange of the
    # integers, both after the last slot (comm/streamed.py)
    maxima = hier_parts(p / m.block * 4, members, links)
    return (hier_parts(p * m.int_bytes, members, links) + maxima).total


def _seconds(m: AnalyticStep, members: tuple[int, ...], extra_lat_s: float) -> float:
    k = sum(members)
    compute = m.compute.ddp_s() if m.reduction == "ddp" else m.compute.perdure_s(k) * m.overhead
    links = m.links.slower(extra_lat_s)
    return (compute + _exposed(m, members, links)) * m.step_overhead


STEP_PARTS = ("compute", "bubble", "replica", "reduction", "runtime")
"""The step by dimension (:func:`step_parts`)."""


def step_parts(m: AnalyticStep, members: tuple[int, ...]) -> dict[str, float]:
    """The step at ``members`` by dimension, seconds, summing to ``m.seconds(members)``:
    the slots' FLOPs, the pipeline bubble, the communication inside the replica not
    hidden (tensor parallel, FSDP), the data-parallel reduction's exposed part, and
    perdure's measured runtime cost (its overhead factors)."""
    c = m.compute
    k = sum(members)
    slots = c.slots / c.workers if m.reduction == "ddp" else math.ceil(c.slots / max(k, 1))
    parts = {
        "compute": slots * c.flops_slot_s,
        "bubble": c.bubble * c.flops_slot_s,
        "replica": (slots + c.bubble) * c.slot_comm_s,
        "reduction": _exposed(m, members, m.links),
    }
    rest = m.seconds(members) - sum(parts.values())
    parts["runtime"] = rest if abs(rest) > 1e-9 * m.seconds(members) else 0.0
    return parts


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


class StepModel(Protocol):
    """What the engine and the policies read of a step model: :class:`AnalyticStep` (a
    synchronous step on a deployment), :class:`HostStep` (this host's benchmarks) or
    :class:`perdure.sim.diloco.DilocoStep` (inner steps per region, an outer step across)."""

    def seconds(
        self, members: tuple[int, ...], extra_lat_s: float = 0.0, starting: int = 0
    ) -> float: ...

    @property
    def ideal_s(self) -> float: ...

    @property
    def slot_s(self) -> float: ...

    def small_allreduce_s(self, members: tuple[int, ...]) -> float: ...


def exact_value_bytes(int_bytes: int, block: int) -> float:
    """Bytes per gradient value the exact reduction puts on the wire: its integer and a
    4-byte block maximum per ``block`` values (the formula; the streamed form measured
    1.005 x fp32's, ``Calibration.streamed_bytes``)."""
    return int_bytes + 4 / block


def cross_region_bytes(m: AnalyticStep, members: tuple[int, ...], params: float) -> float:
    """Bytes that cross a region boundary in one synchronous step, summed over every flow
    (``params``: the whole model's gradient values, every GPU's share together).

    A ring over r regions (regions contiguous, DDP and ``exact_flat``) has r boundary
    edges, each carrying ``2 (k-1)/k`` of the payload; the chain crosses each of its r-1
    boundaries twice (up, then back down); the hierarchical exchange sends each region's
    payload to each of the r-1 others: ``r (r-1)`` payloads."""
    k, r = _spread(members)
    if r <= 1:
        return 0.0
    if m.reduction in ("ddp", "chain"):
        payload = params * m.grad_bytes
    else:
        payload = params * exact_value_bytes(m.int_bytes, m.block)
    if m.reduction == "exact_hier":
        return r * (r - 1) * payload
    if m.reduction == "chain":
        return 2 * (r - 1) * payload
    return r * 2 * (k - 1) / k * payload
