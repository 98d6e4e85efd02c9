"""torchft: a per-step quorum; a failed replica group restarts while the others go on.

A replica group is a node's workers. What each failure costs:

- a group's process dies (its sockets close) or a node goes silent (the survivors'
  collective waits out ``pg_timeout_s``, and the lighthouse its heartbeat timeout): the
  survivors abort the in-flight step and wait
  for a new quorum without it (``quorum_s``: measured, the lighthouse's wait included),
  then train on with fewer groups, each step carrying a smaller batch;
- the failed group restarts once its hardware is back: process start-up (measured) and
  a heal (its state copied from a live peer); its return changes the quorum again, and
  every member re-forms its process group (``join_s``);
- a hang shorter than the collective timeout blocks everyone; a longer one is a death
  whose group heals when it wakes;
- a dropped link: the step is aborted and the process group re-formed, same members;
- a region lost: its groups go; if the lighthouse lived there, nobody trains until a
  lighthouse runs elsewhere (``lighthouse_restart_s``) or the region is back;
- a NaN part: torchft does not check finiteness; a non-finite update reaches every
  replica through the all-reduce, and the job restarts from its last checkpoint;
- a latency spike slows the steps.

Limits: torchft's LocalSGD / DiLoCo modes are not modelled; the pg re-formation at a
join is taken from perdure's measured epoch formation (the only process-group
re-formation measured on this machine).
"""

from __future__ import annotations

from dataclasses import dataclass

from perdure.sim.engine import Context, State
from perdure.sim.failures import Event
from perdure.sim.policies.common import (
    Restart,
    add_members,
    in_lost_region,
    lose_inflight,
    pay,
    pay_restart,
    pay_until,
    rollback,
    set_down,
)


@dataclass(frozen=True)
class Costs:
    quorum_s: float
    """Survivors' abort and new quorum without the failed group."""
    silent_s: float
    """How long survivors wait on a silent peer: their collective's timeout, and at
    least the lighthouse's heartbeat timeout before a quorum can leave it out."""
    join_s: float
    """Everyone's process group re-formed when a group returns."""
    group_start_s: float
    """A restarted group's process start-up and heal."""
    start_cpu_s: float
    """Of which the start-up (CPU on a shared host)."""
    lighthouse_restart_s: float
    """A new lighthouse elsewhere after its region is lost."""
    restart: Restart
    """Every group restarted from the checkpoint (NaN)."""

    @property
    def restart_s(self) -> float:
        return self.restart.total_s


def _batch(ctx: Context, s: State) -> State:
    return s._replace(batch=sum(s.members) / ctx.workers)


def _group_out(
    ctx: Context, s: State, region: int, n: int, detect_s: float, back_in_s: float
) -> tuple[State, tuple[Event, ...]]:
    c: Costs = ctx.costs
    s = _batch(ctx, add_members(lose_inflight(s), ctx, region, -n))
    s = pay(s, detection=detect_s, reform=c.quorum_s)
    t0 = s.t + back_in_s
    return s, (
        Event(t=t0, kind="launch", count=n),
        Event(t=t0 + c.start_cpu_s, kind="started", count=n),
        Event(t=t0 + c.group_start_s, kind="group_back", region=region, count=n),
    )


def policy(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    """torchft's reaction to one event."""
    c: Costs = ctx.costs
    if in_lost_region(s, e.kind, e.region):
        return s, ()
    wpn = ctx.workers_per_node
    if e.kind == "worker_death":
        return _group_out(ctx, s, e.region, wpn, 0.0, e.replace_s)
    if e.kind == "node_death":
        detect = c.silent_s if e.silent else 0.0
        return _group_out(ctx, s, e.region, wpn, detect, e.replace_s)
    if e.kind == "hang":
        if e.duration_s < c.silent_s:
            return pay(s, wait=e.duration_s), ()
        return _group_out(ctx, s, e.region, wpn, c.silent_s, e.duration_s)
    if e.kind == "group_back":
        s = _batch(ctx, add_members(s, ctx, e.region, e.count))
        return pay(s, reform=c.join_s), ()
    if e.kind == "link_flap":
        return pay(lose_inflight(s), reform=c.join_s), ()
    if e.kind == "region_loss":
        return _region_loss(ctx, s, e)
    if e.kind == "region_back":
        return set_down(s, e.region, False), ()
    if e.kind == "nan_part":
        return pay_restart(rollback(lose_inflight(s), ctx), c.restart), ()
    if e.kind == "launch":
        return s._replace(starting=s.starting + e.count), ()
    if e.kind == "started":
        return s._replace(starting=max(0, s.starting - e.count)), ()
    if e.kind == "latency_spike":
        end = Event(t=s.t + e.duration_s, kind="spike_end", extra_latency_s=e.extra_latency_s)
        return s._replace(extra_lat_s=s.extra_lat_s + e.extra_latency_s), (end,)
    if e.kind == "spike_end":
        return s._replace(extra_lat_s=max(0.0, s.extra_lat_s - e.extra_latency_s)), ()
    return s, ()


def _region_loss(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    c: Costs = ctx.costs
    if s.down[e.region]:
        return s, ()
    detect = c.silent_s if e.silent else 0.0
    n = s.members[e.region]
    s, follow = _group_out(ctx, set_down(s, e.region, True), e.region, n, detect, e.duration_s)
    if e.region == ctx.coordinator:  # the lighthouse was there
        s = pay_until(s, s.t + min(e.duration_s, c.lighthouse_restart_s) + c.quorum_s, "wait")
    back = Event(t=s.t + e.duration_s, kind="region_back", region=e.region)
    return s, (*follow, back)
