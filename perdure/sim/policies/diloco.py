"""DiLoCo across regions: perdure inside each region, an outer step every H inner steps.

The step is :class:`perdure.sim.diloco.DilocoStep`. What each failure costs:

- anything inside a region (a worker's or a node's death, a hang, a dropped link, a NaN
  shard, a latency spike): as the ``perdure`` policy does (its detection, epoch change,
  spares, redo of the in-flight step, joins). Conservative: perdure stalls every member,
  where under DiLoCo the other regions go on with their inner steps and wait only at the
  outer step (the same time when the struck region is the slowest);
- a region is lost (or its last worker dies): perdure's reaction (detection, the
  coordinator's failover to the standby, an epoch change; the in-flight step), then its
  virtual replicas move to the survivors (``DilocoStep.placement``), which fetch each
  moved replica's state as of the last outer step (a state copy at perdure's measured
  rate and the cross-region wire: ``copy``) and recompute the inner steps it had done
  since that outer step (``lost``: ``u`` inner steps of one replica's share on its new
  host, ``u < H``); with ``overlap`` the previous outer step's exchange may still be in
  flight when the region goes, and then its H inner steps are recomputed too
  (``u + H``). Meanwhile the survivors host more replicas each: slower inner steps
  (``reduced``) until the region's workers are back and join as perdure's do (the
  join's copy brings the replica home).

Limits: where the replica's state at the last outer step is kept is not modelled (the
copy is taken from a survivor: keeping one outside each region would add cross-region
bytes per outer step, not counted); the statistical effect of a replica's inner steps
being recomputed (none: they are the same steps) and DiLoCo's loss per token are not
simulated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from perdure.sim.diloco import DilocoStep
from perdure.sim.engine import Context, State
from perdure.sim.failures import Event
from perdure.sim.policies import perdure
from perdure.sim.policies.common import pay


@dataclass(frozen=True)
class Costs:
    """DiLoCo's costs on one deployment (built by :mod:`perdure.sim.scenario`)."""

    perdure: perdure.Costs
    """Inside a region: perdure's."""
    replica_copy_s: float
    """A moved replica's state (as of the last outer step) copied to its new host."""


def rounds_position(step: DilocoStep, s: State) -> float:
    """Inner steps since the last outer step whose pseudo-gradients every survivor has:
    the round's position, plus a whole round when the previous exchange (overlapped
    behind this round) was still running."""
    h = step.inner_steps
    u = s.steps - h * math.floor(s.steps / h + 1e-12)
    if step.overlap and u * step.seconds(s.members) < step.outer_s(s.members, s.extra_lat_s):
        u += h
    return u


def _move_orphans(ctx: Context, before: State, after: State) -> State:
    """A region left without members (lost, or its last worker dead): its replicas move
    to the survivors, which fetch each one's state as of the last outer step and
    recompute its inner steps since then."""
    emptied = any(b > 0 and a == 0 for b, a in zip(before.members, after.members, strict=True))
    if not emptied:
        return after
    c: Costs = ctx.costs
    step: DilocoStep = ctx.step  # type: ignore[assignment]
    u = rounds_position(step, before)
    return pay(
        after, copy=c.replica_copy_s, lost=step.recompute_s(before.members, after.members, u)
    )


def policy(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    """The handler the engine calls: perdure's reaction, then the moves of the replicas
    of any region it left without members."""
    c: Costs = ctx.costs
    after, follow = perdure.policy(replace(ctx, costs=c.perdure), s, e)
    return _move_orphans(ctx, s, after), follow


__all__ = ["Costs", "policy"]
