"""From a config and the calibration to what each policy's simulation reads.

The measured costs are loopback numbers of this machine; on a deployment each gains the
one-way latencies of the messages its protocol sends (``*_HOPS``: counted from what the
protocol does, not fitted) and the time its bytes take on the deployment's links. A
state copy runs at the swarm copy's measured share of the links it uses
(``Calibration.swarm``: :class:`~perdure.sim.calibrate.CopyRate`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from perdure.runtime.control.boundary import boundary_margin
from perdure.runtime.control.detector import PhiAccrual
from perdure.sim import sharding
from perdure.sim.calibrate import Calibration, CopyRate
from perdure.sim.config import (
    PerduePolicyConfig,
    SimConfig,
    TorchftPolicyConfig,
    TorchrunPolicyConfig,
    diloco_replicas,
)
from perdure.sim.diloco import DilocoStep, home_replicas
from perdure.sim.engine import Context
from perdure.sim.policies import diloco as diloco_policy
from perdure.sim.policies import perdure as perdure_policy
from perdure.sim.policies import torchft as torchft_policy
from perdure.sim.policies import torchrun as torchrun_policy
from perdure.sim.policies.common import Restart
from perdure.sim.steptime import AnalyticStep, ComputeModel, Links, StepModel

EPOCH_HOPS = 7
"""One-way messages of a membership epoch change: announce, ready, start (coordinator to
workers and back), plus the new process group's rendezvous in the store (a set and a
get: two round trips)."""
RDZV_HOPS = 6
"""A c10d rendezvous round: join, the barrier's wait, the final sync (three round trips)."""
QUORUM_HOPS = 4
"""torchft's quorum: request and answer from the lighthouse, then the process group's
configure in the store (two round trips)."""


def gbps_to_bps(gbps: float) -> float:
    """Gbit/s to bytes/s."""
    return gbps * 1e9 / 8


def links(cfg: SimConfig) -> Links:
    """The links one GPU's flows see. Every GPU of a replica reduces (or copies) its own
    share at once, each on its own NIC inside a region, but all of them share the
    capacity between two regions: a GPU's flow gets ``1 / gpus_per_worker`` of it."""
    d = cfg.deployment
    return Links(
        intra_bps=gbps_to_bps(d.intra_region_gbps),
        intra_lat_s=d.intra_region_latency_ms / 1000,
        cross_bps=gbps_to_bps(d.cross_region_gbps) / d.gpus_per_worker,
        cross_lat_s=d.cross_region_latency_ms / 1000,
    )


def one_way_s(cfg: SimConfig) -> float:
    """The latency a coordinator's message pays to reach every member."""
    d = cfg.deployment
    ms = d.cross_region_latency_ms if len(d.regions) > 1 else d.intra_region_latency_ms
    return ms / 1000


LINE_RATE = CopyRate(per_holder=1.0, cap=1.0, fixed_s=0.0)
"""A copy at its link's rate from one holder, nothing fixed (``Environment``'s default)."""


def wire_bps(cfg: SimConfig) -> float:
    """torchft's heal: one peer's state on the wire; the peer is the first member with
    state, so a group elsewhere gets it across regions."""
    ln = links(cfg)
    return ln.intra_bps if len(cfg.deployment.regions) == 1 else min(ln.intra_bps, ln.cross_bps)


def state_bytes(cfg: SimConfig, cal: Calibration) -> float:
    """State bytes one GPU holds (its replica's 1/(tp pp shard)): every GPU of a replica
    copies, saves and loads its own share at once, each on its own link."""
    per = cfg.workload.state_bytes_per_param or cal.state_bytes_per_param
    return cfg.workload.params * per / sharding.shards(cfg.workload)


def horizon_s(heartbeat_s: float, acceptable_pause_s: float, threshold: float) -> float:
    """Silence until perdure's own phi-accrual detector (``runtime/control/detector.py``)
    declares a worker dead, after a full window of regular heartbeats."""
    d = PhiAccrual(expected_interval_s=heartbeat_s, acceptable_pause_s=acceptable_pause_s)
    for i in range(d.intervals.maxlen or 200):
        d.heartbeat(i * heartbeat_s)
    return d.horizon_s(threshold)


def boundary_s(step_s: float, heartbeat_s: float) -> float:
    """From a joiner's ready heartbeat to its epoch's start: a heartbeat to report it,
    then the margin's steps (the members train on meanwhile)."""
    return heartbeat_s + boundary_margin(step_s, heartbeat_s) * step_s


@dataclass(frozen=True)
class Environment:
    """Where the measured costs are carried: one-way latency, wire rate, storage."""

    one_way_s: float
    wire_bps: float
    storage_gbps: float
    state_bytes: float
    step_s: float
    ckpt_bytes: float | None = None
    """What one GPU saves and loads in a checkpoint (sharded over every GPU); None:
    ``state_bytes`` (a replica's share)."""
    copy: CopyRate = LINE_RATE
    """How a state copy uses its links."""
    copy_bps: float | None = None
    """A joiner's link and a holder's in its own region, bytes/s a GPU; None:
    ``wire_bps``."""
    local_holders: int = 1
    """Holders in a joiner's region when it has members (the smallest region's workers
    but one, at least one)."""
    far_bps: tuple[float, ...] = ()
    """A joiner's links to the holders in the other regions, bytes/s a GPU, one per
    region (each region pair's capacity shared by a replica's GPUs)."""

    @property
    def ckpt(self) -> float:
        return self.state_bytes if self.ckpt_bytes is None else self.ckpt_bytes

    @property
    def sharded_ckpt(self) -> bool:
        """The checkpoint is sharded over every GPU (``checkpoint.bytes_per_gpu``)."""
        return self.ckpt_bytes is not None

    def copy_s(self, local: bool, cap_bps: float | None = None) -> float:
        """A joiner's state copy: from its region's holders and every other region's
        (``local``), or from the other regions' only (its region has no member); every
        link capped at ``cap_bps`` when given."""
        link = self.wire_bps if self.copy_bps is None else self.copy_bps
        links = (link,) * self.local_holders if local else ()
        links += self.far_bps
        if not links:  # one region and no member left: from wherever state is, at link rate
            links = (link,)
        if cap_bps is not None:
            links = tuple(min(x, cap_bps) for x in links)
            link = min(link, cap_bps)
        return self.copy.seconds(self.state_bytes, links, link)


def copy_overlaps(p: PerduePolicyConfig, shard: int = 1, diloco: bool = False) -> bool:
    """Whether a joiner's copy overlaps the epoch's first step, the runtime's rule
    (``runtime/control/copy_rule.py``): ``state_copy`` ``"overlapped"`` or ``"paced"``
    asked, the exact reduction with exponents carried or streamed (``overlap`` ``bucketed`` or
    ``streamed``; ``last_slot`` is the step exponents' form), no FSDP sharding inside a
    replica (``workload.shard`` = 1) and no DiLoCo. Elsewhere the copy stalls the members,
    as the runtime's does. Tensor and pipeline parallel groups are not in the runtime:
    the model assumes each of their GPUs copies its own share as a replica of one GPU."""
    return (
        p.state_copy in ("overlapped", "paced")
        and p.reduction != "chain"
        and p.overlap != "last_slot"
        and shard == 1
        and not diloco
    )


def perdure_costs(
    p: PerduePolicyConfig,
    cal: Calibration,
    env: Environment,
    *,
    shard: int = 1,
    diloco: bool = False,
) -> perdure_policy.Costs:
    """perdure's costs on a deployment; ``shard`` (``workload.shard``) and ``diloco`` say
    whether a copy may overlap (:func:`copy_overlaps`)."""
    reconfigure = cal.perdure_reconfigure_s + EPOCH_HOPS * env.one_way_s
    cap = None if p.copy_gbps is None else gbps_to_bps(p.copy_gbps)
    hb = p.heartbeat_ms / 1000
    return perdure_policy.Costs(
        close_s=env.one_way_s,
        reconfigure_s=reconfigure,
        horizon_s=horizon_s(hb, p.acceptable_pause_ms / 1000, p.phi_threshold),
        settle_s=p.takeover_settle_ms / 1000,
        copy_s=env.copy_s(local=True, cap_bps=cap),
        far_copy_s=env.copy_s(local=False, cap_bps=cap),
        overlapped=copy_overlaps(p, shard, diloco),
        paced=p.state_copy == "paced" and copy_overlaps(p, shard, diloco),
        replace_after_s=p.replace_after_ms / 1000,
        start_s=cal.perdure_replacement_start_s,
        boundary_s=boundary_s(env.step_s, hb),
        # the forms that keep a buffer per slot (the chain, the step exponents) salvage a
        # survivor's finished slots; the streamed form adds them to one accumulator
        salvage=p.reduction == "chain" or p.overlap == "last_slot",
        reform_wait_s=p.reform_backoff_ms / 1000,
    )


def torchrun_restart(cal: Calibration, env: Environment) -> Restart:
    """The measured restart, its checkpoint load replaced by this state's from storage
    (``torch.load`` of the whole state, or ``dcp.load`` of a GPU's shard when the
    checkpoint is sharded over every GPU), plus a rendezvous round's hops."""
    measured_load = cal.torchrun_ckpt_bytes * 8 / (cal.torch_load_gbps * 1e9)
    rate = cal.dcp_load_gbps if env.sharded_ckpt else cal.torch_load_gbps
    load = env.ckpt * 8 / (min(rate, env.storage_gbps) * 1e9)
    return Restart(
        startup_s=cal.torchrun_restart_s - measured_load,
        reform_s=RDZV_HOPS * env.one_way_s,
        load_s=load,
    )


def torchrun_costs(
    t: TorchrunPolicyConfig, cal: Calibration, env: Environment
) -> torchrun_policy.Costs:
    return torchrun_policy.Costs(
        node_timeout_s=t.node_timeout_s,
        collective_timeout_s=t.collective_timeout_s,
        restart=torchrun_restart(cal, env),
    )


def torchft_costs(
    f: TorchftPolicyConfig, cal: Calibration, env: Environment
) -> torchft_policy.Costs:
    """The process start-up of a restarted group is taken from torchrun's measured
    restart (processes, Python, torch, rendezvous on this machine), the heal is the
    state on the wire."""
    heal = env.state_bytes / env.wire_bps
    start = cal.torchrun_restart_s + RDZV_HOPS * env.one_way_s
    return torchft_policy.Costs(
        quorum_s=cal.torchft_quorum_s + QUORUM_HOPS * env.one_way_s,
        silent_s=max(f.pg_timeout_s, f.heartbeat_timeout_ms / 1000),
        join_s=cal.perdure_reconfigure_s + QUORUM_HOPS * env.one_way_s,
        group_start_s=start + heal,
        start_cpu_s=start,
        lighthouse_restart_s=f.lighthouse_restart_minutes * 60,
        restart=torchrun_restart(cal, env),
    )


def step_models(cfg: SimConfig, cal: Calibration) -> dict[str, StepModel]:
    """Each policy's analytic step model on the deployment."""
    w, p, d = cfg.workload, cfg.policies.perdure, cfg.deployment
    base = ComputeModel(
        params=w.params,
        tokens_per_step=w.tokens_per_step,
        slots=w.slots,
        worker_flops=w.gpu_tflops * 1e12 * d.gpus_per_worker,
        workers=d.workers,
        bubble=(w.pp - 1) / w.pp_interleave,
        reduce_params=w.params / sharding.shards(w),
    )
    compute = replace(base, slot_comm_s=sharding.slot_comm_s(w, d, base.flops_slot_s))

    def model(reduction: str) -> AnalyticStep:
        streams = reduction in ("exact_flat", "exact_hier") and p.overlap != "last_slot"
        return AnalyticStep(
            compute=compute,
            links=links(cfg),
            reduction=reduction,
            grad_bytes=w.grad_bytes,
            int_bytes=p.int_bytes,
            block=p.exact_block,
            chain_over_ring=cal.chain_over_ring,
            overhead=1.0 if reduction == "ddp" or streams else cal.perdure_step_overhead,
            overlap=p.overlap,
            step_overhead=cal.streamed_overhead if streams else 1.0,
            streamed_bytes=cal.streamed_bytes,
        )

    return {
        "perdure": model(p.reduction),
        "torchrun": model("ddp"),
        "torchft": model("ddp"),
        "diloco": diloco_step(cfg, model(p.reduction)),
    }


def diloco_step(cfg: SimConfig, sync: AnalyticStep) -> DilocoStep:
    """DiLoCo's step: one replica's inner step is perdure's synchronous step (``sync``)
    on a batch of ``B / R`` tokens in ``S / R`` slots; the slot is the same."""
    d, o = cfg.deployment, cfg.policies.diloco
    r = diloco_replicas(cfg)
    c = sync.compute
    one = replace(c, tokens_per_step=c.tokens_per_step / r, slots=max(1, c.slots // r))
    return DilocoStep(
        replica=replace(sync, compute=one),
        links=sync.links,
        home=home_replicas(r, len(d.regions)),
        inner_steps=o.inner_steps,
        precision=o.precision,
        int_bytes=sync.int_bytes,
        block=sync.block,
        values=c.grad_values,
        overlap=o.overlap,
        ideal=c.ideal_s,
    )


def context(cfg: SimConfig, cal: Calibration, name: str) -> Context:
    """What the policy ``name`` reads when simulating ``cfg``."""
    step = step_models(cfg, cal)[name]
    d = cfg.deployment
    target = tuple(r.nodes * d.workers_per_node for r in d.regions)
    step_s = step.seconds(target)
    ln = links(cfg)
    env = Environment(
        one_way_s=one_way_s(cfg),
        wire_bps=wire_bps(cfg),
        storage_gbps=d.storage_gbps,
        state_bytes=state_bytes(cfg, cal),
        step_s=step_s,
        ckpt_bytes=cfg.checkpoint.bytes_per_gpu,
        copy=cal.swarm,
        copy_bps=ln.intra_bps,
        local_holders=max(1, min(target) - 1),
        far_bps=(ln.cross_bps,) * (len(target) - 1),
    )
    every = max(1.0, round(cfg.checkpoint.every_minutes * 60 / step_s))
    blocking, lag = checkpoint_cost(cfg, cal, "perdure" if name == "diloco" else name, env)
    costs: object
    if name == "perdure":
        costs = perdure_costs(cfg.policies.perdure, cal, env, shard=cfg.workload.shard)
    elif name == "diloco":
        p = perdure_costs(cfg.policies.perdure, cal, env, shard=cfg.workload.shard, diloco=True)
        costs = diloco_policy.Costs(perdure=p, replica_copy_s=p.far_copy_s)
    elif name == "torchrun":
        costs = torchrun_costs(cfg.policies.torchrun, cal, env)
    else:
        costs = torchft_costs(cfg.policies.torchft, cal, env)
    names = [r.name for r in d.regions]
    return Context(
        step=step,
        target=target,
        workers_per_node=d.workers_per_node,
        coordinator=d.coordinator,
        standby=names.index(d.standby_region) if d.standby_region else None,
        spares=cfg.policies.perdure.spares if name in ("perdure", "diloco") else 0,
        ckpt_every_steps=every,
        ckpt_blocking_s=blocking,
        ckpt_lag_steps=lag / step_s,
        costs=costs,
    )


def checkpoint_cost(
    cfg: SimConfig, cal: Calibration, name: str, env: Environment
) -> tuple[float, float]:
    """(seconds a checkpoint blocks the step loop, seconds until it is durable).

    perdure: a snapshot copy blocks; every replica writes 1/W of it in the background, at
    the measured sharded save's rate. torchrun and torchft: a blocking ``torch.save`` of
    the whole state by one rank (the benchmark's), or with ``blocking_save = false`` a
    snapshot and a background write. With ``checkpoint.bytes_per_gpu`` set, every
    policy's GPU snapshots and writes that, the peers at DCP's measured sharded rate."""
    nbits = env.ckpt * 8
    snapshot = nbits / (cal.snapshot_gbps * 1e9)
    if name == "perdure":
        share = 1 if env.sharded_ckpt else cfg.deployment.workers
        write = nbits / share / (min(cal.sharded_save_gbps, env.storage_gbps) * 1e9)
        return snapshot, write
    rate = cal.dcp_save_gbps if env.sharded_ckpt else cal.torch_save_gbps
    write = nbits / (min(rate, env.storage_gbps) * 1e9)
    if cfg.policies.torchrun.blocking_save:
        return write, 0.0
    return snapshot, write
