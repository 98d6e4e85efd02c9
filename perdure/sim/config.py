"""The simulator's config: a deployment, a workload, failure processes and the policies.

Each component is a keyword-only frozen dataclass with a docstring per field, validated in
``__post_init__`` with :class:`perdure.config.Checker`; :func:`load_sim_config` maps a TOML
file onto :class:`SimConfig` with :func:`perdure.config.build`, which reports every problem
of the file at once (key, rule, value).

What is *measured* is not here: detection, re-plan, restart, quorum and copy costs come
from the benchmark result files (:mod:`perdure.sim.calibrate`). What is here describes the
deployment (hardware, links, failure rates) and the settings each system runs with.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from perdure.config import Checker, ConfigError, Problem, build, renamed, renamed_value
from perdure.runtime.config import ClusterConfig

_PERDURE = ClusterConfig()
"""perdure's own defaults, which the simulated perdure policy starts from."""

FailureKind = Literal[
    "worker_death", "node_death", "hang", "link_flap", "latency_spike", "region_loss", "nan_part"
]
FAILURE_KINDS: tuple[str, ...] = FailureKind.__args__  # type: ignore[attr-defined]
RENAMED_KINDS: dict[str, str] = {"nan_shard": "nan_part"}
"""Old failure kind names, still read (with a DeprecationWarning) as the new ones."""
Reduction = Literal["chain", "exact_flat", "exact_hier"]
Overlap = Literal["streamed", "bucketed", "last_slot"]
Precision = Literal["fp32", "int8"]
StateCopy = Literal["overlapped", "stall", "paced"]
STATE_COPIES: tuple[str, ...] = StateCopy.__args__  # type: ignore[attr-defined]


@dataclass(kw_only=True, frozen=True)
class SimRegion:
    """A failure domain of nodes."""

    name: str
    """Region name, unique in the deployment."""
    nodes: int = 1
    """Nodes (machines) in this region."""

    def __post_init__(self) -> None:
        c = Checker()
        c.check(self.name.isidentifier(), "name", "must be an identifier", self.name)
        c.positive("nodes", self.nodes)
        c.done()


@dataclass(kw_only=True, frozen=True)
class DeploymentConfig:
    """Regions, nodes, workers and the links between them."""

    regions: list[SimRegion] = field(default_factory=lambda: [SimRegion(name="local")])
    """Regions and their node counts."""
    workers_per_node: int = 8
    """Workers (replicas, or replica groups) per node; a node's death takes all of them."""
    gpus_per_worker: int = 1
    """Accelerators per worker (a replica group: ``workload.tp x pp x shard``); failure
    rates given per GPU are multiplied by it. A worker's failure takes its whole replica
    group down (a TP or pipeline group cannot run without any of its GPUs)."""
    gpu_memory_gb: float = 80.0
    """Memory of one accelerator, GB (1e9 bytes): a workload that needs more per GPU is
    refused (``sim/sharding.py``: the rule)."""
    nvlink_gbps: float = 3600.0
    """Bandwidth of one GPU's link to the others of its node (tensor parallel), Gbit/s
    (NVLink 4: 450 GB/s a direction)."""
    coordinator_region: str | None = None
    """Where perdure's coordinator and torchft's lighthouse live; default: the first region."""
    standby_region: str | None = None
    """Where perdure's standby coordinator lives; unset: no standby (a loss of the
    coordinator's region then stalls perdure until the region is back)."""
    intra_region_gbps: float = 400.0
    """Bandwidth of one worker's link inside a region, Gbit/s."""
    intra_region_latency_ms: float = 0.01
    """One-way latency between two workers of a region."""
    cross_region_gbps: float = 100.0
    """Capacity between two regions, Gbit/s, shared by every flow that crosses that pair."""
    cross_region_latency_ms: float = 30.0
    """One-way latency between two regions."""
    storage_gbps: float = 40.0
    """Checkpoint storage bandwidth seen by one worker (read or write), Gbit/s."""

    def __post_init__(self) -> None:
        c = Checker()
        names = [r.name for r in self.regions]
        c.check(bool(names), "regions", "must list at least one region", names)
        c.check(len(set(names)) == len(names), "regions", "names must be unique", names)
        c.positive("workers_per_node", self.workers_per_node)
        c.positive("gpus_per_worker", self.gpus_per_worker)
        c.positive("gpu_memory_gb", self.gpu_memory_gb)
        c.positive("nvlink_gbps", self.nvlink_gbps)
        for key in ("coordinator_region", "standby_region"):
            v = getattr(self, key)
            if v is not None:
                c.check(v in names, key, f"must name a region of {names}", v)
        for key in ("intra_region_gbps", "cross_region_gbps", "storage_gbps"):
            c.positive(key, getattr(self, key))
        c.non_negative("intra_region_latency_ms", self.intra_region_latency_ms)
        c.non_negative("cross_region_latency_ms", self.cross_region_latency_ms)
        c.done()

    @property
    def workers(self) -> int:
        return sum(r.nodes for r in self.regions) * self.workers_per_node

    @property
    def nodes(self) -> int:
        return sum(r.nodes for r in self.regions)

    @property
    def coordinator(self) -> int:
        """Index of the coordinator's region."""
        names = [r.name for r in self.regions]
        return names.index(self.coordinator_region) if self.coordinator_region else 0


@dataclass(kw_only=True, frozen=True)
class WorkloadConfig:
    """What is trained, and for how long."""

    params: float = 1.0e9
    """Model parameters (P)."""
    tokens_per_step: float = 4.0e6
    """Tokens of one global batch."""
    slots: int = 4
    """perdure's slots per step (S): a step's batch is cut into S fixed slots, and a
    member computes whole slots, so with k members a step takes ceil(S/k) slot times."""
    gpu_tflops: float = 400.0
    """Achieved training throughput of one GPU, TFLOP/s (peak x model FLOP utilisation);
    compute per step is 6 P tokens / (GPUs x this)."""
    grad_bytes: int = 4
    """Bytes per gradient value on the wire for a float reduction (chain, DDP), and in
    memory."""
    tp: int = 1
    """Tensor-parallel degree inside a replica (over NVLink, inside a node)."""
    pp: int = 1
    """Pipeline stages of a replica (1F1B: a step of m micro-batches takes m + pp - 1
    micro-batch times)."""
    pp_interleave: int = 1
    """Virtual pipeline stages per GPU (interleaved 1F1B): the bubble is (pp - 1) / this
    micro-batch times."""
    shard: int = 1
    """FSDP/HSDP shard degree inside a replica: parameters, gradients and optimizer state
    split this many ways (ZeRO-3), each shard GPU computing its own data."""
    layers: int = 16
    """Transformer layers (activation memory, tensor-parallel traffic)."""
    hidden: int = 2048
    """Hidden size (activation memory, tensor-parallel traffic)."""
    recompute: bool = False
    """Full activation recomputation: only each layer's input is kept."""
    weight_bytes: int = 2
    """Bytes per parameter of the weights the forward reads (bf16)."""
    optimizer_bytes: int = 12
    """Bytes per parameter of the optimizer's state (fp32 master weights + Adam's two
    moments)."""
    state_bytes_per_param: float | None = None
    """Bytes of model + optimizer state per parameter (what a state copy or a checkpoint
    moves); unset: measured (``scaling.json`` checkpoint bytes / params)."""
    days: float = 30.0
    """Length of the simulated run (wall clock)."""
    steps: int | None = None
    """Run until this many steps have committed instead of for ``days`` (validation)."""

    def __post_init__(self) -> None:
        c = Checker()
        c.positive("params", self.params)
        c.positive("tokens_per_step", self.tokens_per_step)
        c.positive("slots", self.slots)
        c.positive("gpu_tflops", self.gpu_tflops)
        c.check(self.grad_bytes in (2, 4), "grad_bytes", "must be 2 or 4", self.grad_bytes)
        for key in ("tp", "pp", "pp_interleave", "shard", "layers", "hidden", "weight_bytes"):
            c.positive(key, getattr(self, key))
        c.non_negative("optimizer_bytes", self.optimizer_bytes)
        if self.state_bytes_per_param is not None:
            c.positive("state_bytes_per_param", self.state_bytes_per_param)
        c.positive("days", self.days)
        if self.steps is not None:
            c.positive("steps", self.steps)
        c.done()


@dataclass(kw_only=True, frozen=True)
class CheckpointConfig:
    """How often every policy checkpoints; the cost of each save is measured."""

    every_minutes: float = 30.0
    """Interval between checkpoints (converted to steps at the fault-free step time)."""
    bytes_per_gpu: float | None = None
    """Bytes one GPU saves and a restarted GPU loads (a checkpoint sharded over every GPU
    of the job, e.g. optimizer state split across data-parallel ranks as well); unset:
    the GPU's share of its replica's state (``sim/scenario.py``). State copies to a
    joiner always move the replica share."""

    def __post_init__(self) -> None:
        c = Checker()
        c.positive("every_minutes", self.every_minutes)
        if self.bytes_per_gpu is not None:
            c.positive("bytes_per_gpu", self.bytes_per_gpu)
        c.done()


@dataclass(kw_only=True, frozen=True)
class FailureProcess:
    """One failure process: a rate (Poisson, over the whole deployment) or a schedule.

    A rate is ``share`` x the reference rate (per GPU-hour, :class:`ReferenceRate`) x the
    deployment's GPUs, or ``per_day`` directly; both may be zero. ``at_hours`` adds
    failures at fixed times. Each strikes a uniformly chosen target of its kind's scope
    (a worker, a node, a region, a cross-region link)."""

    kind: FailureKind = field(metadata=renamed(RENAMED_KINDS))
    """``worker_death`` (one worker's process dies: its socket closes), ``node_death`` (a
    machine stops: no socket closes, peers must time out), ``hang`` (a worker stops
    responding for ``duration_s``), ``link_flap`` (one collective fails), ``latency_spike``
    (every cross-region link gains ``extra_latency_ms`` for ``duration_s``),
    ``region_loss`` (a region is gone for ``duration_s``), ``nan_part`` (a dataset
    part yields non-finite gradients; ``nan_shard``, its old name, is read as it)."""
    share: float = 0.0
    """Fraction of the reference per-GPU rate that is of this kind."""
    per_day: float = 0.0
    """Rate over the whole deployment, per day (added to the share)."""
    at_hours: list[float] = field(default_factory=list)
    """Scheduled failures, hours after the start."""
    duration_s: float = 0.0
    """How long a hang, spike or region loss lasts."""
    extra_latency_ms: float = 0.0
    """Extra one-way latency of a spike."""
    replace_minutes: float = 0.0
    """Time until failed hardware is back or replaced (worker or node death): 0 means a
    process restart on the same hardware."""
    region: str | None = None
    """Strike only this region (its name); unset: a region drawn in proportion to its nodes."""
    silent: bool = True
    """A node death or region loss is silent (power, a partition: no socket closes, so
    peers must time out); false: its processes are killed (sockets close at once)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", renamed_value(self.kind, RENAMED_KINDS, "kind"))
        c = Checker()
        c.non_negative("share", self.share)
        c.non_negative("per_day", self.per_day)
        for i, h in enumerate(self.at_hours):
            c.non_negative(f"at_hours[{i}]", h)
        c.non_negative("duration_s", self.duration_s)
        c.non_negative("extra_latency_ms", self.extra_latency_ms)
        c.non_negative("replace_minutes", self.replace_minutes)
        timed = self.kind in ("hang", "latency_spike", "region_loss")
        if timed:
            c.positive("duration_s", self.duration_s)
        if self.kind == "latency_spike":
            c.positive("extra_latency_ms", self.extra_latency_ms)
        c.done()


@dataclass(kw_only=True, frozen=True)
class ReferenceRate:
    """A measured interruption rate that failure shares are fractions of.

    Default: Llama 3 405B pre-training (Dubey et al. 2024, section 3.3.4): 419 unexpected
    interruptions in a 54-day snapshot on 16,384 H100 GPUs, i.e. 419 / (16,384 x 54 x 24)
    = 1.97e-5 per GPU-hour (one per GPU every 5.8 years; one per 8-GPU node every 264
    days). The paper attributes 58.7% to GPUs (GPU, HBM3, SRAM, GPU system processor)
    and 8.4% to network switches and cables."""

    interruptions: float = 419.0
    """Interruptions observed."""
    days: float = 54.0
    """Over this many days."""
    gpus: float = 16384.0
    """On this many GPUs."""
    scale: float = 1.0
    """Multiplier on every rate of :class:`FailureProcess` (the failure-rate sweep)."""

    def __post_init__(self) -> None:
        c = Checker()
        c.non_negative("interruptions", self.interruptions)
        c.positive("days", self.days)
        c.positive("gpus", self.gpus)
        c.non_negative("scale", self.scale)
        c.done()

    @property
    def per_gpu_hour(self) -> float:
        return self.interruptions / (self.gpus * self.days * 24.0)


@dataclass(kw_only=True, frozen=True)
class PerduePolicyConfig:
    """perdure's settings (defaults: perdure's own, ``perdure.runtime.config``)."""

    reduction: Reduction = "chain"
    """``chain`` (the left fold along the ranks), ``exact_flat`` or ``exact_hier`` (integer
    block sums through the backend's ring all_reduce, flat or inside each region then
    across regions). A death salvages the survivors' finished slots with the chain and
    with ``overlap = "last_slot"`` (the step form: a buffer per slot); the streamed forms
    add a member's slots to one accumulator, so the in-flight step is lost."""
    overlap: Overlap = "bucketed"
    """How the exact reduction overlaps the backward (``sim/steptime.py``): ``bucketed``
    (the runtime's default, ``reduction_exponents = "streamed"``: each member's last
    slot's buckets on the wire as its backward finishes them, its earlier slots added
    locally, as DDP with ``no_sync`` micro-batches, the two-tier exchange of
    ``exact_hier`` bucketed too, ``comm/tiers.py`` ``TieredBuckets``), ``streamed`` (the
    same with the two-tier exchange in one piece after the last slot, as the runtime did
    before it was bucketed) or ``last_slot`` (the pre-streaming step: step exponents, a MAX
    round then the payload, once the last slot is done, hidden behind that slot's
    backward only). The chain is always ``last_slot``."""
    int_bytes: int = 4
    """Bytes per value of the exact reduction's integer payload (int32 or int64)."""
    exact_block: int = 256
    """Values per block exponent of the exact reduction (its MAX all-reduce moves one
    4-byte exponent per block)."""
    spares: int = _PERDURE.spares
    """Warm standby workers: a death promotes one at once, the replacement refills the pool."""
    heartbeat_ms: float = float(_PERDURE.heartbeat_ms)
    """Worker heartbeat interval (phi-accrual input)."""
    phi_threshold: float = float(_PERDURE.phi_threshold)
    """Phi above which a silent worker is declared dead."""
    acceptable_pause_ms: float = float(_PERDURE.acceptable_pause_ms)
    """Silence tolerated before suspicion grows (spikes shorter than this evict nobody)."""
    takeover_settle_ms: float = float(_PERDURE.takeover_settle_ms)
    """The standby coordinator's settle time before its first epoch."""
    replace_after_ms: float = float(_PERDURE.replace_after_ms)
    """The launcher's delay before it starts a replacement process."""
    state_copy: StateCopy = "overlapped"
    """How a joiner (a promoted spare, a replacement, a woken worker) gets its state: from
    every member that holds it (the swarm copy, ``runtime/comm/swarm.py``, at its measured
    rate: ``calibrate.CopyRate``), and while what waits. ``overlapped`` (the runtime's,
    ``runtime/member/copy_overlap.py``): the epoch's first step gives the joiner no slot;
    the members compute it while the joiner copies and its reduction waits for the copy,
    so the members pay the epoch change and at most the joiner's share of one step when
    the copy is shorter than that step. Only where the runtime overlaps
    (``runtime/control/copy_rule.py``: an exact reduction with ``overlap`` ``bucketed`` or
    ``streamed``, ``workload.shard`` = 1, not DiLoCo); elsewhere it stalls. ``stall``:
    every member waits at the epoch's start until the copy is done. ``paced`` (the
    runtime's default ``cluster.copy_pace = "auto"``, ``runtime/member/copy_pacing.py``, where it
    overlaps): the copy is spread over the steps it takes, a part behind each step's
    compute, so no member waits for it; the joiner has no slot until it is done."""
    copy_gbps: float | None = None
    """Caps every link a state copy uses at this rate, Gbit/s a GPU (the copy-rate sweep:
    the swarm copy is measured on 0.1-0.3 Gbit/s links, not at NIC rates); unset: the
    deployment's links."""
    reform_backoff_ms: float = float(_PERDURE.reform_backoff_ms)
    """After a collective fails with nobody lost (a dropped link), the wait for a death
    that would explain it before the same members re-form."""

    def __post_init__(self) -> None:
        c = Checker()
        c.check(self.int_bytes in (4, 8), "int_bytes", "must be 4 or 8", self.int_bytes)
        c.positive("exact_block", self.exact_block)
        c.non_negative("spares", self.spares)
        c.positive("heartbeat_ms", self.heartbeat_ms)
        c.positive("phi_threshold", self.phi_threshold)
        c.non_negative("acceptable_pause_ms", self.acceptable_pause_ms)
        c.positive("takeover_settle_ms", self.takeover_settle_ms)
        c.non_negative("replace_after_ms", self.replace_after_ms)
        c.positive("reform_backoff_ms", self.reform_backoff_ms)
        c.one_of("state_copy", self.state_copy, STATE_COPIES)
        if self.copy_gbps is not None:
            c.positive("copy_gbps", self.copy_gbps)
        c.done()


@dataclass(kw_only=True, frozen=True)
class TorchrunPolicyConfig:
    """torchrun / TorchElastic with DDP: any failure restarts every process from the last
    checkpoint."""

    node_timeout_s: float = 15.0
    """Until a silent node is dropped from the c10d rendezvous (keep-alive 5 s x 3
    attempts, torch's defaults)."""
    collective_timeout_s: float = 600.0
    """NCCL watchdog timeout: how long a hang blocks everyone before the job aborts."""
    blocking_save: bool = True
    """A checkpoint blocks training for its whole write (torch.save), as in the benchmark;
    false: only for a snapshot (an async save such as DCP's)."""

    def __post_init__(self) -> None:
        c = Checker()
        c.positive("node_timeout_s", self.node_timeout_s)
        c.positive("collective_timeout_s", self.collective_timeout_s)
        c.done()


@dataclass(kw_only=True, frozen=True)
class TorchftPolicyConfig:
    """torchft: per-step quorum from a lighthouse; a failed replica group (a node)
    restarts and heals from a peer while the others go on at a reduced batch."""

    heartbeat_timeout_ms: float = 5000.0
    """The lighthouse drops a replica group silent for this long."""
    pg_timeout_s: float = 10.0
    """Timeout of the groups' collectives: how long survivors wait on a silent peer."""
    lighthouse_restart_minutes: float = 10.0
    """Time to start a lighthouse elsewhere when its region is lost."""

    def __post_init__(self) -> None:
        c = Checker()
        c.positive("heartbeat_timeout_ms", self.heartbeat_timeout_ms)
        c.positive("pg_timeout_s", self.pg_timeout_s)
        c.non_negative("lighthouse_restart_minutes", self.lighthouse_restart_minutes)
        c.done()


@dataclass(kw_only=True, frozen=True)
class DilocoPolicyConfig:
    """DiLoCo across regions (``sim/diloco.py``, ``sim/policies/diloco.py``; the runtime's
    ``[outer]``): R virtual replicas, each on one region's workers, run H inner steps
    with only intra-region communication, then an outer step sums their pseudo-gradients
    across regions. Inside a region the inner step is perdure's (``policies.perdure``:
    its reduction, overlap, spares and recovery). The model's statistical efficiency
    (loss per token) is not simulated."""

    replicas: int | None = None
    """R: virtual replicas, fixed whatever the membership; replica i is at home in region
    ``i mod regions``; unset: one per region. At least the deployment's regions, and
    ``workload.slots`` must be a multiple of it (a replica's batch is ``S / R`` slots)."""
    inner_steps: int = 50
    """H: inner steps per outer step."""
    precision: Precision = "fp32"
    """The pseudo-gradient on the cross-region wire: ``fp32`` (through the exact
    reduction, the synchronous step's bytes a value) or ``int8`` (one byte a value and a
    one-byte exponent per ``policies.perdure.exact_block`` values)."""
    overlap: bool = False
    """Apply the outer update one outer step late, so that the exchange runs behind the
    next H inner steps (exposed only by what it lasts beyond them)."""

    def __post_init__(self) -> None:
        c = Checker()
        if self.replicas is not None:
            c.positive("replicas", self.replicas)
        c.positive("inner_steps", self.inner_steps)
        c.one_of("precision", self.precision, ("fp32", "int8"))
        c.done()


@dataclass(kw_only=True, frozen=True)
class PoliciesConfig:
    """The policies to simulate and the settings of each."""

    run: list[Literal["perdure", "torchrun", "torchft", "diloco"]] = field(
        default_factory=lambda: ["perdure", "torchrun", "torchft"]
    )
    """Which policies to simulate, in this order."""
    perdure: PerduePolicyConfig = field(default_factory=PerduePolicyConfig)
    """perdure's settings."""
    perdure_reductions: list[Reduction] = field(default_factory=list)
    """Also simulate perdure with each of these reductions (rows ``perdure/<reduction>``);
    empty: only ``perdure.reduction``."""
    perdure_overlaps: list[Overlap] = field(default_factory=list)
    """Also simulate each exact reduction of ``perdure_reductions`` with each of these
    overlap models (rows ``perdure/<reduction>/<overlap>``); empty: only
    ``perdure.overlap``."""
    perdure_state_copies: list[StateCopy] = field(default_factory=list)
    """Also simulate each perdure row with each of these state copies (rows ending
    ``/overlapped`` or ``/stall``; no ``/overlapped`` row for a form whose copy the
    runtime stalls, when ``stall`` is listed); empty: only ``perdure.state_copy``."""
    diloco: DilocoPolicyConfig = field(default_factory=DilocoPolicyConfig)
    """DiLoCo's settings (simulated when ``run`` names ``diloco``)."""
    diloco_inner_steps: list[int] = field(default_factory=list)
    """Simulate DiLoCo once per H listed (rows ``diloco/H<H>/<precision>``); empty: only
    ``diloco.inner_steps``."""
    diloco_precisions: list[Precision] = field(default_factory=list)
    """Simulate DiLoCo once per pseudo-gradient precision listed; empty: only
    ``diloco.precision``."""
    diloco_overlaps: list[bool] = field(default_factory=list)
    """Simulate DiLoCo with and/or without the overlapped outer step (rows ending
    ``/overlap`` for true); empty: only ``diloco.overlap``."""
    torchrun: TorchrunPolicyConfig = field(default_factory=TorchrunPolicyConfig)
    """torchrun's settings."""
    torchft: TorchftPolicyConfig = field(default_factory=TorchftPolicyConfig)
    """torchft's settings."""

    def __post_init__(self) -> None:
        c = Checker()
        c.check(bool(self.run), "run", "must name at least one policy", self.run)
        c.check(len(set(self.run)) == len(self.run), "run", "names must be unique", self.run)
        for i, h in enumerate(self.diloco_inner_steps):
            c.positive(f"diloco_inner_steps[{i}]", h)
        for i, p in enumerate(self.diloco_precisions):
            c.one_of(f"diloco_precisions[{i}]", p, ("fp32", "int8"))
        for i, sc in enumerate(self.perdure_state_copies):
            c.one_of(f"perdure_state_copies[{i}]", sc, STATE_COPIES)
        c.done()


@dataclass(kw_only=True, frozen=True)
class SweepConfig:
    """Values to sweep, one parameter at a time around the config; an empty list skips."""

    rate_scale: list[float] = field(default_factory=lambda: [0.3, 1.0, 3.0, 10.0, 30.0])
    """Multipliers on every failure rate."""
    checkpoint_minutes: list[float] = field(default_factory=lambda: [5.0, 15.0, 30.0, 60.0])
    """Checkpoint intervals."""
    spares: list[int] = field(default_factory=lambda: [0, 1, 2, 4, 8])
    """perdure's warm spares."""
    cross_region_latency_ms: list[float] = field(default_factory=lambda: [5.0, 30.0, 100.0])
    """One-way cross-region latencies."""
    cross_region_gbps: list[float] = field(default_factory=list)
    """Capacities between two regions, Gbit/s (where DiLoCo's outer step pays off)."""
    copy_gbps: list[float] = field(default_factory=list)
    """perdure's state-copy link rates, Gbit/s a GPU (``policies.perdure.copy_gbps``):
    down to what rate the conclusions hold."""
    seeds: int = 4
    """Seeds per sweep point."""

    def __post_init__(self) -> None:
        c = Checker()
        for key in (
            "rate_scale",
            "checkpoint_minutes",
            "cross_region_latency_ms",
            "cross_region_gbps",
            "copy_gbps",
        ):
            for i, v in enumerate(getattr(self, key)):
                c.positive(f"{key}[{i}]", v)
        for i, v in enumerate(self.spares):
            c.non_negative(f"spares[{i}]", v)
        c.positive("seeds", self.seeds)
        c.done()


@dataclass(kw_only=True, frozen=True)
class SimConfig:
    """A simulated training run: where, what, which failures, which policies."""

    deployment: DeploymentConfig = field(default_factory=DeploymentConfig)
    """Regions, nodes, workers, links."""
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    """Model, batch, throughput, run length."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpoint interval."""
    reference_rate: ReferenceRate = field(default_factory=ReferenceRate)
    """The interruption rate failure shares refer to."""
    failures: list[FailureProcess] = field(default_factory=list)
    """Failure processes."""
    policies: PoliciesConfig = field(default_factory=PoliciesConfig)
    """Policies and their settings."""
    sweeps: SweepConfig = field(default_factory=SweepConfig)
    """Sweeps printed and plotted after the main table."""
    seeds: int = 10
    """Seeds of the main table (each seed draws one failure history, shared by every
    policy so that they face the same failures)."""
    results_dir: str = "benchmarks/results"
    """Where the calibration's result files are (relative: to the config file's
    repository root, i.e. the current directory)."""

    def __post_init__(self) -> None:
        c = Checker()
        c.positive("seeds", self.seeds)
        _check_replica(c, self)
        if "diloco" in self.policies.run:
            _check_diloco(c, self)
        names = [r.name for r in self.deployment.regions]
        for i, f in enumerate(self.failures):
            if f.region is not None:
                c.check(
                    f.region in names,
                    f"failures[{i}].region",
                    f"must name a region of {names}",
                    f.region,
                )
        c.done()


def _check_replica(c: Checker, cfg: SimConfig) -> None:
    """A worker is one replica group, and one GPU of it must hold its share."""
    from perdure.sim import sharding

    w, d = cfg.workload, cfg.deployment
    gpus = sharding.shards(w)
    c.check(
        d.gpus_per_worker == gpus,
        "deployment.gpus_per_worker",
        f"must be workload.tp x pp x shard = {w.tp} x {w.pp} x {w.shard} = {gpus}",
        d.gpus_per_worker,
    )
    perdure = "perdure" in cfg.policies.run
    need = sharding.memory(w, d, perdure=perdure, int_bytes=cfg.policies.perdure.int_bytes)
    c.check(
        need.total <= d.gpu_memory_gb * sharding.GB,
        "workload",
        f"does not fit: needs {need.describe()} per GPU "
        f"({'perdure' if perdure else 'DDP'}; sim/sharding.py), above "
        f"deployment.gpu_memory_gb = {d.gpu_memory_gb:g} GB; raise tp, pp or shard, "
        "or set recompute",
        f"params = {w.params:g}, tp = {w.tp}, pp = {w.pp}, shard = {w.shard}",
    )


def diloco_replicas(cfg: SimConfig) -> int:
    """R: ``policies.diloco.replicas``, or one per region."""
    r = cfg.policies.diloco.replicas
    return len(cfg.deployment.regions) if r is None else r


def _check_diloco(c: Checker, cfg: SimConfig) -> None:
    """Every region hosts a replica at full strength; a replica's batch is whole slots."""
    regions, replicas = len(cfg.deployment.regions), diloco_replicas(cfg)
    c.check(
        replicas >= regions,
        "policies.diloco.replicas",
        f"must be at least the deployment's {regions} regions (a region without a "
        "replica would idle)",
        replicas,
    )
    c.check(
        cfg.workload.slots % replicas == 0,
        "workload.slots",
        f"must be a multiple of policies.diloco.replicas = {replicas} (a replica's batch "
        "is S / R slots)",
        cfg.workload.slots,
    )


def load_sim_config(path: str | Path) -> SimConfig:
    """Read a TOML file into a :class:`SimConfig`; every problem is reported at once."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except OSError as e:
        raise ConfigError(
            [Problem("<file>", f"cannot be read: {e.strerror}", str(p))], str(p)
        ) from e
    except tomllib.TOMLDecodeError as e:
        raise ConfigError([Problem("<file>", f"not valid TOML: {e}", str(p))], str(p)) from e
    try:
        return build(SimConfig, data)
    except ConfigError as e:
        raise ConfigError(e.problems, str(p)) from None
