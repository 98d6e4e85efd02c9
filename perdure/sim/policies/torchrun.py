"""torchrun / TorchElastic with DDP: any failure restarts every process from a checkpoint.

What each failure costs (a fixed world size, as the benchmark and most jobs run):

- a crashed worker (or a dropped link: NCCL's error ends the process): its agent sees the
  exit at its next poll (inside the measured restart, taken with a 0.1 s monitor
  interval); a silent node: the c10d rendezvous drops it after
  its keep-alive timeout; a hang: the NCCL watchdog aborts after its timeout (a shorter
  hang just blocks everyone); a lost region: its nodes time out, and with a fixed world
  size the job waits for the region to come back;
- then, once replacement hardware is there (the failure's ``replace_minutes``), every
  process restarts (``restart_s``: measured here, plus the deployment's checkpoint load
  and rendezvous hops) and redoes every step since the newest durable checkpoint;
- a NaN part: the training script's loss check stops the job, which restarts from the
  last checkpoint (DDP cannot tell which shard: the shard is skipped by hand, not here);
- a latency spike slows the steps, like everyone's.

Limits: no elastic shrink (``--nnodes min:max``); the restart cost measured with 3
processes on one host is carried to the deployment with only the load and rendezvous
added (NCCL communicator set-up at scale is not counted, which favours torchrun).
"""

from __future__ import annotations

from dataclasses import dataclass

from perdure.sim.engine import Context, State
from perdure.sim.failures import Event
from perdure.sim.policies.common import (
    Restart,
    lose_inflight,
    pay,
    pay_restart,
    pay_until,
    rollback,
)


@dataclass(frozen=True)
class Costs:
    node_timeout_s: float
    """A silent node dropped by the rendezvous."""
    collective_timeout_s: float
    """NCCL watchdog: a hang blocks everyone this long before the job aborts."""
    restart: Restart
    """Every process restarted, the checkpoint loaded, rendezvous done."""

    @property
    def restart_s(self) -> float:
        return self.restart.total_s


def _restart(ctx: Context, s: State, detect_s: float, wait_s: float) -> State:
    """Everything restarts ``detect_s + wait_s`` from now and redoes the steps since the
    checkpoint."""
    c: Costs = ctx.costs
    s = rollback(lose_inflight(s), ctx)
    s = pay_until(s, s.t + detect_s, "detection")
    s = pay_until(s, s.t + detect_s + wait_s, "wait")
    return pay_restart(s, c.restart)


def policy(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    """torchrun's reaction to one event."""
    c: Costs = ctx.costs
    if e.kind in ("worker_death", "link_flap"):
        return _restart(ctx, s, 0.0, e.replace_s), ()
    if e.kind == "node_death":
        detect = c.node_timeout_s if e.silent else 0.0
        return _restart(ctx, s, detect, e.replace_s), ()
    if e.kind == "hang":
        if e.duration_s < c.collective_timeout_s:
            return pay(s, wait=e.duration_s), ()
        return _restart(ctx, s, c.collective_timeout_s, 0.0), ()
    if e.kind == "region_loss":
        detect = c.node_timeout_s if e.silent else 0.0
        return _restart(ctx, s, detect, max(0.0, e.duration_s - detect)), ()
    if e.kind == "nan_part":
        return _restart(ctx, s, 0.0, 0.0), ()
    if e.kind == "latency_spike":
        end = Event(t=s.t + e.duration_s, kind="spike_end", extra_latency_s=e.extra_latency_s)
        return s._replace(extra_lat_s=s.extra_lat_s + e.extra_latency_s), (end,)
    if e.kind == "spike_end":
        return s._replace(extra_lat_s=max(0.0, s.extra_lat_s - e.extra_latency_s)), ()
    return s, ()
