"""Configs of the training task, the optimizer, the step schedule and the cluster."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal

from perdure.config import MATH, MATH_ADDED, Checker, math_only_if, math_unless


@dataclass(kw_only=True, frozen=True)
class TaskConfig:
    """What is trained: an importable factory and its options."""

    entry: str = field(default="examples.tiny_lm.task:make_task", metadata=MATH)
    """``module:function`` returning a :class:`perdure.Task`; the module must be importable."""
    options: dict[str, Any] = field(default_factory=dict, metadata=MATH)
    """Keyword arguments passed to the factory (model sizes, dropout, ...)."""
    init: Literal["eager", "per_module"] = field(default="eager", metadata=MATH_ADDED)
    """How the initial parameters are drawn. ``eager``: as the factory builds them, from the
    run seed's one stream (the whole model on every worker). ``per_module``: the factory
    runs with its parameters on ``meta`` and each module's own parameters are then drawn
    from a seed of (run seed, module name), by the task's ``Task.init`` or the module's
    ``reset_parameters`` (``runtime/replica/deferred.py``), so a rank can make just its
    shard: with ``train.shard_params`` a worker never holds the whole model. Other initial
    bits than ``eager``'s, so a math setting (``eager``, the math of runs before the field
    existed, is left out of the config hash: their checkpoints keep their hash)."""

    def __post_init__(self) -> None:
        c = Checker()
        mod, _, fn = self.entry.partition(":")
        c.check(bool(mod and fn), "entry", "must be 'module:function'", self.entry)
        c.done()


@dataclass(kw_only=True, frozen=True)
class OptimConfig:
    """The optimizer and its learning-rate schedule; every field changes the math."""

    name: Literal["adamw", "sgd"] = field(default="adamw", metadata=MATH)
    """Optimizer: ``adamw`` (torch.optim.AdamW) or ``sgd`` (with momentum)."""
    lr: float = field(default=3e-3, metadata=MATH)
    """Peak learning rate."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95], metadata=MATH)
    """AdamW betas (two numbers in [0, 1))."""
    eps: float = field(default=1e-8, metadata=MATH)
    """AdamW epsilon."""
    weight_decay: float = field(default=0.0, metadata=MATH)
    """Decoupled weight decay."""
    momentum: float = field(default=0.9, metadata=MATH)
    """SGD momentum (ignored by AdamW)."""
    warmup_steps: int = field(default=0, metadata=MATH)
    """Linear warm-up from 0 to ``lr`` over this many steps."""
    schedule: Literal["constant", "cosine"] = field(default="cosine", metadata=MATH)
    """Learning rate after warm-up: constant, or cosine decay to ``min_lr_ratio * lr``."""
    min_lr_ratio: float = field(default=0.1, metadata=MATH)
    """Floor of the cosine schedule as a fraction of ``lr``."""
    grad_clip: float | None = field(default=1.0, metadata=MATH)
    """Clip the global gradient norm to this value; unset disables clipping."""

    def __post_init__(self) -> None:
        c = Checker()
        c.positive("lr", self.lr)
        ok = len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas)
        c.check(ok, "betas", "must be two numbers in [0, 1)", self.betas)
        c.positive("eps", self.eps)
        c.non_negative("weight_decay", self.weight_decay)
        c.check(0 <= self.momentum < 1, "momentum", "must be in [0, 1)", self.momentum)
        c.non_negative("warmup_steps", self.warmup_steps)
        c.check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]", self.min_lr_ratio)
        if self.grad_clip is not None:
            c.positive("grad_clip", self.grad_clip)
        c.done()


@dataclass(kw_only=True, frozen=True)
class TrainConfig:
    """The step schedule and the slot layout; every field but ``shard_degree`` changes the
    math."""

    steps: int = field(default=300, metadata=MATH)
    """Optimizer steps of the run (the LR schedule is laid over them)."""
    global_batch: int = field(default=32, metadata=MATH)
    """Samples per step (B), fixed whatever the number of workers."""
    slots: int = field(default=16, metadata=MATH)
    """Slots per step (S); B must be a multiple of S. More slots than workers lets the
    planner balance load; each slot costs one forward/backward call."""
    seed: int = field(default=1234, metadata=MATH)
    """Root seed: model init, data order, and the per-(step, slot) dropout streams."""
    threads_per_worker: int = field(default=1, metadata=MATH)
    """Intra-op threads of every worker (torch.set_num_threads). The bits of a slot's
    gradient depend on it on the CPU, so it is part of the math."""
    reduction: Literal["chain", "exact"] = field(default="exact", metadata=MATH)
    """How slot gradients are summed across workers. ``exact`` (the default): each slot
    rounded to fixed point against a per-block exponent and the integers summed by the
    backend's all_reduce (order-independent, so any grouping, bucket order or sharding
    gives the same bits; see runtime/comm/exact.py and streamed.py); with the default
    ``reduction_bits`` and ``reduction_exponents``, DDP's bytes on the wire, streamed
    behind the backward. ``chain``: a pipelined chain along the ranks that adds the fp32
    slot gradients in slot order (a left fold over slots, whoever holds them), after the
    backward; the default until the exact reduction matched DDP's step
    (docs/performance.md section 16), kept for the runs and checkpoints made with it (set it to
    resume them: their config hash is unchanged). The reduction fixes the rounding of the
    sum, so it is part of the math. ``reduction_bits``, ``_block`` and ``_exponents`` are
    the exact reduction's: the chain ignores them."""
    reduction_bits: Literal[32, 64] = field(
        default=32, metadata=math_unless("reduction", "exact", 64)
    )
    """Integer width of the ``exact`` reduction: 32 (the default) puts DDP's fp32 bytes on
    the wire and keeps ~26 bits below each block's maximum (values far below it take the
    streamed form's outlier lane); 64 doubles the bytes and keeps ~58 bits."""
    reduction_block: int = field(default=256, metadata=math_unless("reduction", "exact", 256))
    """Values sharing one exponent in the ``exact`` reduction."""
    reduction_exponents: Literal["step", "carried", "streamed"] = field(
        default="streamed", metadata=math_unless("reduction", "exact", "step")
    )
    """Where the ``exact`` reduction's exponents come from. ``step``: a MAX round over the
    step's slots before any value is converted (a rank keeps every slot's buffer until
    then: slots x P). ``carried``: predicted from the previous step's and verified with
    the step's own (runtime/comm/carried.py): each slot is added to one accumulator as it
    finishes (O(P) whatever the slot count) and no round precedes the sum; a step whose
    prediction misses, and the first step, are computed twice. A different rounding (one
    exponent per bucket of up to 1M values), so part of the math; 64-bit only.
    ``streamed`` (the default): one exponent per block (``reduction_block`` values),
    predicted from the previous step's block maxima with headroom and verified by a MAX of
    them sent behind the gradient (runtime/comm/streamed.py); each bucket of a member's
    last slot goes on the wire as soon as its backward has finished it, as DDP's do. 32 or 64 bits:
    with 32, DDP's bytes on the wire (plus one int32 per block). A step whose prediction
    misses, and the first step, are computed twice."""
    precision: Literal["fp32", "bf16", "fp16"] = field(default="fp32", metadata=MATH)
    """Arithmetic of the forward pass. ``bf16``: the forward and the loss run under
    ``torch.autocast`` in bfloat16 (matmuls, convolutions; reductions and norms stay fp32
    as autocast decides), the backward follows its casts; parameters, their gradients,
    the optimizer state and the reduction stay fp32. ``fp16``: the same in float16, for
    GPUs without bfloat16 (CPU autocast accepts float16 too), with a deterministic dynamic
    loss scale (``loss_scale_*``, ``runtime/replica/loss_scale.py``): float16's range is
    narrow, so the loss is multiplied by the scale before the backward and the reduced
    gradient divided by it (exactly: a power of two). The bits still depend only on the
    slots, never on who computed them."""
    loss_scale_init: float = field(default=65536.0, metadata=math_only_if("precision", "fp16"))
    """``fp16`` only: the loss scale of the first step (torch's ``GradScaler`` default,
    2**16). A power of two in [``loss_scale_min``, 2**64], so that multiplying the loss
    and dividing the gradient by it are exact."""
    loss_scale_growth_interval: int = field(
        default=2000, metadata=math_only_if("precision", "fp16")
    )
    """``fp16`` only: after this many steps in a row without an overflow, the scale is
    multiplied by ``loss_scale_growth_factor`` (torch's default, 2000)."""
    loss_scale_growth_factor: float = field(default=2.0, metadata=math_only_if("precision", "fp16"))
    """``fp16`` only: what the scale is multiplied by when it grows; a power of two >= 2."""
    loss_scale_backoff_factor: float = field(
        default=0.5, metadata=math_only_if("precision", "fp16")
    )
    """``fp16`` only: what the scale is multiplied by on an overflow (a slot whose loss is
    finite and whose gradient is not), before the step is computed again; a power of two
    < 1."""
    loss_scale_min: float = field(default=1.0, metadata=math_only_if("precision", "fp16"))
    """``fp16`` only: the floor of the scale; a power of two in [2**-24, 2**64]. A slot
    that overflows at the floor stops the run (the gradient itself exceeds float16: use
    ``bf16`` or ``fp32``), rather than blame its data or its worker."""
    shard_degree: int = 1
    """Ranks per replica group (HSDP-style sharding, ``runtime/member/shard_group.py``): the
    optimizer state is split over the k ranks of each group, each rank keeping and updating
    the whole parameters it owns and broadcasting them to its group after the step; a membership
    epoch then has a multiple of k members (the rest wait as spares). Not part of the
    math: every parameter is updated whole, by the same kernels, from the same exact sum,
    so the bits are the same for every k. The parameters stay whole on every rank unless
    ``shard_params`` is set too (then a rank keeps about 1/k of both)."""
    shard_params: bool = False
    """With ``shard_degree`` > 1: the parameters are sharded at rest too, not only the
    optimizer state (``runtime/replica/param_gather.py``). A rank keeps the parameters its shard
    owns; the others are gathered from their owners while a slot runs, a unit (the largest
    modules within a quarter of a shard's share, as FSDP wraps blocks) at a time, and freed
    after use, so a rank holds about 1/k of the parameters and of the optimizer state (plus
    the unit in flight). Not part of the math: a gathered parameter is its owner's bytes.
    Costs a broadcast per unit and owner in the forward and again in the backward, per
    slot (see docs/performance.md), and every rank of a group computes as many slots as the busiest
    one (a rank with fewer computes throwaway ones: the gathers are collectives of the
    group). Limits: the gradient sum keeps its whole size on every rank (with
    ``shard_reduce = "scatter"`` only the own range of it is reduced and converted; with
    ``shard_reduce_slots = "each"`` a rank of several slots holds its range's integers);
    re-running a non-finite slot holds the whole parameters for a moment (a checkpoint is
    read by shard: each rank reads only its tensors' byte ranges); a
    model whose use of parameters depends on the data (an expert router) cannot run so;
    a joiner's state copy blocks the epoch's start (its group's gathers need its shard:
    ``control/copy_rule.py``), where with whole parameters it runs behind the first step."""
    shard_prefetch: bool = True
    """With ``shard_params``: the next gather unit's broadcasts start while the current
    unit computes, in the forward and in the backward (FSDP2's explicit prefetch;
    ``runtime/replica/param_gather.py``), so one unit's bytes are on the wire behind the other's
    compute, at the cost of holding one more unit. Not part of the math: the same bytes
    arrive, only earlier. ``false``: each unit is gathered when it is first used."""
    shard_reduce: Literal["auto", "whole", "scatter"] = "auto"
    """How a replica group's ranks get the step's gradient (``train.shard_degree`` > 1).
    ``scatter``: the integer sum is reduce-scattered inside the group (each rank receives
    its shard's contiguous range of the slot buffer) and all-reduced across groups among
    the ranks of the same shard, then only that range is converted back (HSDP's
    reduce-scatter: half the bytes of an all-reduce per rank inside the group, 1/k across
    groups; on gloo the first tier is an all-reduce inside the group, of which a rank keeps
    its range, since gloo's reduce_scatter measured slower than its all-reduce); gradient
    clipping then sums its per-parameter norms over the group. ``whole``:
    every rank all-reduces the whole sum over every member and drops the foreign part.
    ``auto``: ``scatter`` wherever it is possible, else ``whole``. ``scatter`` needs
    ``train.reduction = "exact"`` (either form of its exponents; integers: any grouping
    of the additions gives the same bits, so not part of the math). Where each
    shard cannot own one contiguous range (gather units of ``shard_params`` that interleave
    in the buffer's order), a run falls back to ``whole`` and logs why."""
    shard_reduce_slots: Literal["once", "each"] = "once"
    """With several slots per rank in a replica group, when its gradient sum is
    reduce-scattered (FSDP2's two choices under gradient accumulation). ``once`` (the
    default): a rank adds its slots into one local integer accumulator and reduces it once,
    its last slot's buckets behind its backward (O(P) gradient memory, DDP's bytes on the
    wire). ``each``: every slot's buckets are reduce-scattered inside the group as its
    backward finishes them, into the rank's 1/k accumulator, and the cross-group all-reduce
    runs once on that shard at the end (O(P/k) plus the buckets in flight; the group's
    bytes once per slot, FSDP2's reduce-scatter without ``no_sync``). A performance
    setting, not part of the math: integer sums are associative, so both give the same
    bits. ``each`` needs ``reduction = "exact"`` with ``reduction_exponents = "streamed"``
    and ``shard_degree`` > 1 (``comm/streamed.py``, ``Rounds``); it takes effect where the
    group reduce-scatters (``shard_reduce``) and the reduction is not in region tiers
    (``cluster.hierarchical_reduce`` with several regions): elsewhere a rank reduces once.
    Measured in docs/performance.md section 12f. With ``each`` a joiner's state copy
    blocks the epoch's start (every slot's rounds are the step's collectives:
    ``control/copy_rule.py``)."""
    device: Literal["cpu", "cuda"] = field(default="cpu", metadata=MATH)
    """Where the model computes: ``cpu``, or ``cuda`` (each worker on one GPU of its host,
    in deterministic mode: TF32 off, deterministic cuDNN and cuBLAS; see
    ``runtime/replica/placement.py``, and ``cluster.data_plane`` for where the slot buffers and
    the collectives live). Kernels differ in their bits between devices, so it is part of
    the math. Checked before any worker starts: ``cuda`` on a host without CUDA is
    refused. Limit: the CUDA paths have not run on a GPU yet."""

    def __post_init__(self) -> None:
        c = Checker()
        c.positive("steps", self.steps)
        c.positive("global_batch", self.global_batch)
        c.positive("slots", self.slots)
        if self.slots > 0:
            c.check(
                self.global_batch % self.slots == 0,
                "global_batch",
                f"must be a multiple of train.slots ({self.slots})",
                self.global_batch,
            )
        c.non_negative("seed", self.seed)
        c.positive("threads_per_worker", self.threads_per_worker)
        c.positive("shard_degree", self.shard_degree)
        if self.slots > 0:
            c.check(
                self.shard_degree <= self.slots,
                "shard_degree",
                f"must be at most train.slots ({self.slots}): every rank computes a slot",
                self.shard_degree,
            )
        c.check(
            not self.shard_params or self.shard_degree > 1,
            "shard_params",
            "needs train.shard_degree > 1 (the parameters are sharded over a replica group)",
            self.shard_params,
        )
        c.check(
            self.reduction != "exact"
            or self.reduction_exponents != "carried"
            or self.reduction_bits == 64,
            "reduction_exponents",
            "'carried' needs train.reduction_bits = 64 (one exponent per bucket of up to 1M "
            "values leaves 32-bit integers too few bits; 'streamed' carries one per block)",
            self.reduction_exponents,
        )
        c.check(
            self.shard_reduce != "scatter" or self.reduction == "exact",
            "shard_reduce",
            "'scatter' needs train.reduction = 'exact' (the chain's left fold is no sum of "
            "integers that any grouping may add)",
            self.shard_reduce,
        )
        each = self.shard_reduce_slots == "each"
        c.check(
            not each or (self.reduction == "exact" and self.reduction_exponents == "streamed"),
            "shard_reduce_slots",
            "'each' needs train.reduction = 'exact' with train.reduction_exponents = "
            f"'streamed' (got {self.reduction!r} with {self.reduction_exponents!r}): only the "
            "streamed form reduce-scatters each slot as its backward finishes it",
            self.shard_reduce_slots,
        )
        c.check(
            not each or self.shard_degree > 1,
            "shard_reduce_slots",
            "'each' needs train.shard_degree > 1 (a slot is reduce-scattered inside a "
            "replica group)",
            self.shard_reduce_slots,
        )
        c.check(
            not each or self.shard_reduce != "whole",
            "shard_reduce_slots",
            "'each' needs train.shard_reduce 'scatter' or 'auto' (a slot is "
            "reduce-scattered, not reduced whole)",
            self.shard_reduce_slots,
        )
        c.check(
            1 <= self.reduction_block <= 1 << 20,
            "reduction_block",
            "must be in [1, 1048576]",
            self.reduction_block,
        )
        self._check_loss_scale(c)
        c.done()

    def _check_loss_scale(self, c: Checker) -> None:
        """The loss scale's fields (checked whatever the precision: a typo is a typo)."""
        low, high = 2.0**-24, 2.0**64
        fits = _power_of_two(self.loss_scale_min) and low <= self.loss_scale_min <= high
        c.check(fits, "loss_scale_min", "must be a power of two in [2**-24, 2**64]",
                self.loss_scale_min)  # fmt: skip
        init = self.loss_scale_init
        ok = _power_of_two(init) and max(low, self.loss_scale_min) <= init <= high
        c.check(ok, "loss_scale_init",
                f"must be a power of two in [train.loss_scale_min ({self.loss_scale_min!r}), "
                "2**64]", init)  # fmt: skip
        ok = type(self.loss_scale_growth_interval) is int and self.loss_scale_growth_interval > 0
        c.check(ok, "loss_scale_growth_interval", "must be an integer > 0",
                self.loss_scale_growth_interval)  # fmt: skip
        grow = self.loss_scale_growth_factor
        c.check(_power_of_two(grow) and 2 <= grow <= 2.0**16, "loss_scale_growth_factor",
                "must be a power of two in [2, 65536]", grow)  # fmt: skip
        back = self.loss_scale_backoff_factor
        c.check(_power_of_two(back) and 2.0**-16 <= back < 1, "loss_scale_backoff_factor",
                "must be a power of two in [2**-16, 1)", back)  # fmt: skip

    @property
    def slot_size(self) -> int:
        return self.global_batch // self.slots

    @property
    def scatters(self) -> bool:
        """Whether replica groups reduce-scatter the gradient (``shard_reduce``), where
        each shard's range can be contiguous."""
        possible = self.reduction == "exact"
        return self.shard_degree > 1 and self.shard_reduce != "whole" and possible


def _power_of_two(x: object) -> bool:
    """A finite float (or int) > 0 whose mantissa is 1: 2**k for an integer k."""
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    return math.isfinite(x) and x > 0 and math.frexp(x)[0] == 0.5


@dataclass(kw_only=True, frozen=True)
class RegionConfig:
    """A failure domain of nodes; on the local launcher, a label on worker processes."""

    name: str
    """Region name, unique in the cluster."""
    workers: int = 2
    """Workers started in this region."""

    def __post_init__(self) -> None:
        c = Checker()
        c.check(
            bool(self.name) and self.name.isidentifier(), "name", "must be an identifier", self.name
        )
        c.non_negative("workers", self.workers)
        c.done()


@dataclass(kw_only=True, frozen=True)
class ClusterConfig:
    """Who runs the math and how failures are detected; none of it changes the math."""

    regions: list[RegionConfig] = field(
        default_factory=lambda: [RegionConfig(name="local", workers=2)]
    )
    """Regions and their worker counts."""
    coordinator_region: str | None = None
    """Region the coordinator is considered to live in (a ``region_down`` of it takes the
    coordinator down too); default: the first region."""
    standby_region: str | None = None
    """Region of the standby coordinator that takes over when the primary is lost; unset
    means no standby."""
    host: str = "127.0.0.1"
    """Address every listener of the coordinator (control channel, store, metrics) binds,
    and nothing else; ``perdure coordinator --host`` overrides it (one config serves the
    primary and the standby, each on its own host). On a cluster, this machine's own
    address; a wildcard (``0.0.0.0``) needs ``advertise``."""
    advertise: str | None = None
    """Address workers and the standby dial to reach the coordinator (``--advertise``);
    default: ``host``. Set it when peers reach the coordinator through another address
    than the one it binds (a NAT, a Kubernetes Service)."""
    port: int = 0
    """Port of the coordinator's store (``--store-port``); 0 picks a free one."""
    channel_port: int = 0
    """Port of the coordinator's control channel (``--channel-port``), what workers'
    ``--coordinator HOST:PORT`` names; 0 picks a free one, which workers can then only
    learn from the ports file: fix it on a cluster."""
    heartbeat_ms: int = 100
    """Interval of worker heartbeats."""
    phi_threshold: float = 10.0
    """Phi-accrual threshold above which a silent worker is declared dead (8 to 12 is the
    usual practice)."""
    acceptable_pause_ms: int = 4000
    """Heartbeat silence tolerated before suspicion starts to grow: latency spikes shorter
    than this evict nobody; a hung worker is declared dead a little after it."""
    min_collective_timeout_ms: int = 10000
    """Floor of the adaptive collective timeout. The failure detector, not this timeout,
    decides that a peer is dead; the timeout is a backstop for a stuck collective, so it
    stays above the detection horizon (acceptable pause plus a few heartbeats)."""
    reform_backoff_ms: int = 50
    """After a collective fails with no member lost (a dropped link, a peer that cannot
    be reached), wait this long before re-forming the same members; the wait doubles with
    each further failure before a step commits (exponential backoff)."""
    reform_backoff_max_ms: int = 5000
    """Longest wait between two re-formations of the same members."""
    max_reform_failures: int = 10
    """Consecutive collective failures with no member lost and no step committed after
    which the run stops (``run_failed``, with the last error as the cause) instead of
    re-forming for ever: a data plane that never forms is a configuration problem (an
    unroutable address, a closed port), not a fault to absorb."""
    ha_backend: Literal["embedded", "etcd"] = "embedded"
    """Where the coordinators' lease lives, which decides who may coordinate and raises the
    generation that fences out an old primary. ``embedded``: a file in the run directory
    (one host, or hosts whose shared run directory has working ``flock`` and atomic
    rename). ``etcd``: a key under an etcd lease (``etcd_endpoints``), for a coordinator
    that must survive the loss of the host or region holding the run directory's server."""
    lease_ttl_ms: int = 2000
    """The coordinator lease's time to live. A standby takes over no sooner than this after
    the primary's last renewal (and only if it cannot reach a serving primary); a primary
    renews every quarter of it and stops coordinating before it runs out. etcd rounds it up
    to whole seconds (and to its own minimum, 2 s by default)."""
    etcd_endpoints: list[str] = field(default_factory=list)
    """``http(s)://HOST:PORT`` of the etcd servers (client URLs), tried in order; required
    with ``ha_backend = "etcd"``."""
    etcd_prefix: str = "/perdure"
    """Key prefix of the run's lease in etcd (a hash of the run token follows it)."""
    takeover_settle_ms: int = 500
    """A standby coordinator that takes over waits this long after the last worker
    reconnects before it forms the next membership epoch."""
    join_timeout_ms: int = 60000
    """How long a worker waits to be admitted or for a membership epoch to form."""
    replace_after_ms: int = 500
    """Delay before the local launcher starts a replacement for a dead worker; negative
    disables replacement."""
    preload_task: bool = True
    """The local launcher's fork server (the zygote every worker is forked from) imports
    the module of ``task.entry`` before it forks, so that a replacement does not pay for
    the task's imports (``transformers``: seconds). The task is still built in each
    worker. Turn it off for a module that starts threads or opens a device at import
    time, which a fork would copy in that state."""
    spares: int = 0
    """Warm standby workers started by the local launcher (imported, registered, holding
    no slots) that take over a dead worker's place at once."""
    slow_ratio: float = 2.0
    """A member is slow when its seconds per slot exceed this multiple of the median; the
    planner then moves slots away from it."""
    max_slot_moves: int = 2
    """Most slots one re-plan moves (bounded, so that plans do not oscillate)."""
    replan_interval_ms: int = 2000
    """Least time between two re-plans, and between an epoch's start and a re-plan."""
    bench_lag_ms: int = 500
    """Bench-out: a member whose link is this much later than the others' (measured from
    its heartbeats, ``control/lag.py``), when the others are faster without it, leaves
    the collective at once: no slots, not waited for, not evicted (the step in flight is
    redone, its finished slots salvaged where the reduction keeps them). Once its lag
    stays under half of this for ``replan_interval_ms`` it is planned back in and
    receives the state. 0: never."""
    evict_after_suspect: int = 2
    """Evict a worker after this many non-finite slots that did not reproduce on another
    worker (a hardware suspect rather than bad data)."""
    data_plane: Literal["auto", "gloo", "nccl"] = "auto"
    """The collectives' backend: ``auto`` is NCCL for ``train.device = 'cuda'`` (slot
    buffers on the GPU, one GPU per worker) and gloo for ``cpu``; ``gloo`` with ``cuda``
    keeps the slot buffers and collectives in host memory, for workers that share a GPU.
    Not part of the math: the reductions are perdure's own arithmetic."""
    hierarchical_reduce: bool = True
    """With ``train.reduction = "exact"`` and several regions: all-reduce inside each
    region, then among one leader per region, then broadcast inside the region, so the
    slow links carry one exchange per region whatever the worker count
    (runtime/comm/tiers.py). The sum is exact either way: not a math setting."""
    cross_region_reduce: Literal["auto", "direct", "ring"] = "auto"
    """How the regions' leaders combine an exact sum over the slow links (with
    ``hierarchical_reduce``). ``direct``: every leader sends its buffer to every other at
    once, one one-way delay, R - 1 buffers out of each leader. ``ring``: the backend's
    all-reduce among the leaders (gloo's ring: 2(R - 1)/R of a buffer out of each, half
    the bytes at R = 4, in 2(R - 1) delays one after another). ``auto``: ``direct`` for
    the synchronous step, whose buckets are latency-bound behind the backward; ``ring``
    for DiLoCo's outer step (``outer.replicas``), whose one reduction per H inner steps is
    bandwidth-bound. The sum is exact either way: not a math setting. (For one buffer of
    N bytes at link rate B and one-way delay d, the ring is faster once
    (R - 1)(R - 2)/R x N/B > (2R - 3) d: at R = 4, N/B > 3.3 d.)"""
    fingerprint_every: int = 10
    """Compare a fingerprint of every replica's parameters every this many steps."""
    copy_pace: Literal["auto", "fixed", "whole"] = "auto"
    """How a joiner's state copy spreads over steps, where it overlaps the survivors'
    steps (``control/copy_rule.py``) and ``train.shard_degree`` = 1; elsewhere it is whole.
    Paced, the state moves in parts, whole parameters with their optimizer state, each
    served by the holders behind one step's compute while the receiver takes part in every
    step's reduction with no slot and applies each update to what it holds
    (``runtime/member/copy_pacing.py``), so that a copy longer than a step still costs no
    member a wait: the holders carry the receiver's slots until the last part is in.
    ``auto`` (the default): the first part ``copy_step_mb``, each later one what the
    source measured the copy to move in its compute of a step (a state within the first
    part copies as ``whole`` does). ``fixed``: ``copy_step_mb`` a part. ``whole``: the
    whole state behind the epoch's first step, whose reduction waits for the rest of a copy
    longer than that step. Not part of the math: the received bits are the holders'.
    Until its last part the receiver writes no share of a checkpoint (the holders write
    it) and evaluates nothing. Limits: a run that ends before the last part (a drain)
    completes the copy first (blocking); an automatic part is sized by the last one's rate,
    so a link that slows down shows by the difference for a step."""
    copy_step_mb: float = 64.0
    """MB (10**6 bytes) of a paced copy's part: every part's with ``copy_pace = "fixed"``,
    the first one's with ``"auto"`` (its measured rate sizes the next)."""

    def __post_init__(self) -> None:
        c = Checker()
        names = [r.name for r in self.regions]
        c.check(len(self.regions) > 0, "regions", "must list at least one region", names)
        c.check(len(set(names)) == len(names), "regions", "names must be unique", names)
        c.check(sum(r.workers for r in self.regions) > 0, "regions", "need >= 1 worker", names)
        for key in ("coordinator_region", "standby_region"):
            v = getattr(self, key)
            if v is not None:
                c.check(v in names, key, f"must name a region of {names}", v)
        c.check(0 <= self.port < 65536, "port", "must be in [0, 65535]", self.port)
        c.check(
            0 <= self.channel_port < 65536,
            "channel_port",
            "must be in [0, 65535]",
            self.channel_port,
        )
        c.check(
            self.port == 0 or self.port != self.channel_port,
            "channel_port",
            f"must differ from cluster.port ({self.port})",
            self.channel_port,
        )
        c.check(bool(self.host.strip()), "host", "must be an address or host name", self.host)
        if self.advertise is not None:
            ok = bool(self.advertise.strip()) and not _wildcard(self.advertise)
            c.check(ok, "advertise", "must be an address peers can dial", self.advertise)
        c.positive("heartbeat_ms", self.heartbeat_ms)
        c.positive("phi_threshold", self.phi_threshold)
        c.non_negative("acceptable_pause_ms", self.acceptable_pause_ms)
        c.positive("min_collective_timeout_ms", self.min_collective_timeout_ms)
        c.positive("reform_backoff_ms", self.reform_backoff_ms)
        c.check(
            self.reform_backoff_max_ms >= self.reform_backoff_ms,
            "reform_backoff_max_ms",
            f"must be >= cluster.reform_backoff_ms ({self.reform_backoff_ms})",
            self.reform_backoff_max_ms,
        )
        c.positive("max_reform_failures", self.max_reform_failures)
        c.check(self.lease_ttl_ms >= 500, "lease_ttl_ms", "must be >= 500", self.lease_ttl_ms)
        if self.ha_backend == "etcd":
            c.check(
                bool(self.etcd_endpoints),
                "etcd_endpoints",
                'must name at least one endpoint with ha_backend = "etcd"',
                self.etcd_endpoints,
            )
        for url in self.etcd_endpoints:
            c.check(_http_url(url), "etcd_endpoints", "must be http(s)://HOST:PORT", url)
        c.check(
            self.etcd_prefix.startswith("/") and " " not in self.etcd_prefix,
            "etcd_prefix",
            "must start with '/' and hold no spaces",
            self.etcd_prefix,
        )
        c.positive("takeover_settle_ms", self.takeover_settle_ms)
        c.positive("join_timeout_ms", self.join_timeout_ms)
        c.non_negative("spares", self.spares)
        c.check(self.slow_ratio > 1, "slow_ratio", "must be > 1", self.slow_ratio)
        c.positive("max_slot_moves", self.max_slot_moves)
        c.positive("replan_interval_ms", self.replan_interval_ms)
        c.non_negative("bench_lag_ms", self.bench_lag_ms)
        c.positive("evict_after_suspect", self.evict_after_suspect)
        c.positive("fingerprint_every", self.fingerprint_every)
        c.check(
            math.isfinite(self.copy_step_mb) and self.copy_step_mb > 0,
            "copy_step_mb",
            "must be a finite number > 0",
            self.copy_step_mb,
        )
        c.one_of("copy_pace", self.copy_pace, ("auto", "fixed", "whole"))
        c.done()

    @property
    def workers(self) -> int:
        return sum(r.workers for r in self.regions)


def _wildcard(host: str) -> bool:
    return host.strip() in ("0.0.0.0", "::", "[::]", "*")


def _http_url(url: str) -> bool:
    from urllib.parse import urlsplit

    try:
        u = urlsplit(url)
        return u.scheme in ("http", "https") and bool(u.hostname) and u.port is not None
    except ValueError:
        return False


@dataclass(kw_only=True, frozen=True)
class EvalConfig:
    """Evaluation during a run (``runtime/member/evaluate.py``): the task's ``eval_fn`` (or its
    ``loss_fn``) over fixed samples of a held-out dataset, every ``every_steps`` steps.
    None of it changes the math: the evaluation runs on every member (rank 0 logs it) after
    the step has committed, under no gradient, with every generator saved and restored around it, so
    a run's bits are the same with it on or off (not in the config hash)."""

    every_steps: int = 0
    """Evaluate after every this many committed steps (after step ``every_steps - 1``,
    ``2 * every_steps - 1``, ...); 0: never."""
    dataset: str | None = None
    """The held-out data set (built by ``perdure data build`` or ``data import``, e.g. the
    test split of an imported array), found like ``data.dataset``. Required with
    ``every_steps``: samples held out of the training data set itself would change its
    order, hence the training math, so a held-out split is a data set of its own."""
    samples: int = 256
    """How many of its samples each evaluation reads: evenly spaced sample ids over the
    whole data set (the same ones every time, whatever the membership); 0: all of them."""
    batch_size: int = 32
    """Samples per call of the evaluation function."""

    def __post_init__(self) -> None:
        c = Checker()
        c.non_negative("every_steps", self.every_steps)
        c.check(
            not self.every_steps or bool(self.dataset),
            "dataset",
            "must name a held-out data set when eval.every_steps is set",
            self.dataset,
        )
        c.non_negative("samples", self.samples)
        c.positive("batch_size", self.batch_size)
        c.done()


@dataclass(kw_only=True, frozen=True)
class OuterConfig:
    """DiLoCo across regions (``runtime/replica/outer.py``; docs/architecture.md, "DiLoCo"):
    ``replicas`` fixed virtual replicas each run ``inner_steps`` steps of the task's own
    optimizer from the outer parameters on data of their own, and one outer step (Nesterov
    SGD) applies the mean of their pseudo-gradients (outer parameters minus a replica's).
    A perdure step is then one outer step and its slots are the virtual replicas, so the
    planner places replicas on members as it places slots, and the pseudo-gradients are
    summed exactly (integers) whoever computed which: the run is a pure function of the
    config as before. Off by default (``replicas = 0``: the synchronous step); every field
    at its default is left out of the config hash, so runs made before it keep theirs."""

    replicas: int = field(default=0, metadata=MATH_ADDED)
    """R: virtual replicas, fixed whatever the membership; 0: off (the synchronous step).
    Must equal ``train.slots`` (a slot is a replica); ``train.global_batch`` is then the
    samples of one inner step over all replicas (B/R each), so an outer step reads
    ``inner_steps`` x B samples: those of the synchronous run's steps
    ``t * inner_steps .. (t + 1) * inner_steps - 1``, replica r taking slot r of each."""
    inner_steps: int = field(default=50, metadata=MATH_ADDED)
    """H: inner steps per outer step (DiLoCo's H). ``train.steps`` counts outer steps, and
    the inner learning-rate schedule (``optim``) is laid over ``train.steps`` x H inner
    steps."""
    lr: float = field(default=0.7, metadata=MATH_ADDED)
    """The outer optimizer's learning rate (DiLoCo: 0.7)."""
    momentum: float = field(default=0.9, metadata=MATH_ADDED)
    """The outer optimizer's Nesterov momentum (DiLoCo: 0.9)."""
    precision: Literal["fp32", "int8"] = field(default="fp32", metadata=MATH_ADDED)
    """A replica's pseudo-gradient as the outer step receives it. ``fp32``: as computed,
    summed by the exact reduction (``train.reduction``). ``int8``: rounded to 8 bits (a sign
    and 7 bits, round-half-even) per block of ``train.reduction_block`` values against the
    power of two of the block's own maximum, a pure function of the replica's values
    (INTELLECT-1's int8 pseudo-gradients; their error feedback is ``error_feedback``),
    and put on the wire as such: an all-gather of every replica's int8 values and one-byte
    block exponents, which every member decodes and adds in replica order
    (``comm/int8_gather.py``), a quarter of the exact reduction's 32-bit bytes. Limit: the
    all-gather is flat over the members, not in ``cluster.hierarchical_reduce``'s tiers."""
    error_feedback: bool = field(default=False, metadata=MATH_ADDED)
    """int8 only: EF21 error feedback. Each virtual replica r has an estimate ``g_r`` of its
    pseudo-gradient (zero at the start); the wire carries the int8 rounding of the
    difference ``delta_r - g_r``, every member adds the decoded difference to its copy of
    ``g_r``, and the outer step takes the mean of the new estimates. An estimate is a
    function of the records on the wire alone, so every member holds all R of them, the
    same bits, whichever member computed which replica: a replica moves with nothing to
    copy, and a checkpoint or state copy carries them (R x the parameters in float32).
    Where a replica's pseudo-gradient changes slowly between outer steps the difference,
    and so its rounding error, shrinks step by step; where it changes a lot the error is
    plain int8's or larger (EF21 does not accumulate the error, so nothing is owed back).
    Refused with ``precision = "fp32"`` (nothing is rounded)."""

    delay: int = field(default=0, metadata=MATH_ADDED)
    """Outer steps between an outer step's pseudo-gradients and their update: 0 (DiLoCo:
    outer step t's mean moves the parameters that step t + 1's replicas start from) or 1
    (one step late, as streaming/overlapped DiLoCo: outer step t applies step t - 1's
    mean, and step 0 moves nothing; the replicas of step t + 1 then start from parameters
    that do not depend on step t's reduction). The last step's mean is left pending, in
    the checkpoint (``"pending"``). With 1, step t's reduction runs on the comm thread
    behind step t + 1's replicas and is waited for at the next outer boundary (a
    checkpoint or a fingerprint comparison waits for it at once); with fp32 it needs
    ``train.reduction_exponents = "step"``."""

    wire_compression: Literal["zlib", "none"] = "zlib"
    """int8 only: the records of an outer step go on the wire compressed, losslessly
    (``zlib``, level 1: ~2 ms a record of 120k values; int8 pseudo-gradients, peaked near
    zero, shrink by 10-25 %, unused records to nothing), at the cost of one more small
    all-gather (the sizes) before the records. The records arrive bit for bit: not a math
    setting. ``none``: the records as they are."""

    def __post_init__(self) -> None:
        c = Checker()
        c.non_negative("replicas", self.replicas)
        c.one_of("wire_compression", self.wire_compression, ("zlib", "none"))
        c.one_of("delay", self.delay, (0, 1))
        c.positive("inner_steps", self.inner_steps)
        c.positive("lr", self.lr)
        c.check(0 <= self.momentum < 1, "momentum", "must be in [0, 1)", self.momentum)
        c.one_of("precision", self.precision, ("fp32", "int8"))
        c.check(
            not self.error_feedback or self.precision == "int8",
            "error_feedback",
            "needs precision = 'int8' (fp32 pseudo-gradients are not rounded: there is no "
            "error to feed back)",
            self.error_feedback,
        )
        c.done()

    @property
    def on(self) -> bool:
        """Whether the run steps as DiLoCo (``replicas`` > 0)."""
        return self.replicas > 0
