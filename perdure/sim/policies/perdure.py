"""perdure: re-plan around a failure; no survivor restarts, no committed step is lost.

What each failure costs, as ``docs/architecture.md`` describes the runtime:

- a worker's process dies: its socket closes (peers know within a one-way latency), the
  survivors form a new membership epoch (``reconfigure_s``, measured) and redo the
  in-flight step (the chain: its slot gradients died with the worker) or keep their
  finished slots (the exact reduction: only the dead worker's share is redone). A warm
  spare, if any, is promoted into the same epoch; otherwise the survivors take the dead
  worker's slots until its replacement, started after ``replace_after_ms``, is planned
  in at a step boundary (an epoch change). Either joiner gets its state by a copy
  (:func:`_plan_in`): with ``state_copy = "stall"`` every member waits for it, with
  ``"overlapped"`` (where the runtime overlaps, ``scenario.copy_overlaps``) the members
  compute the epoch's first step without the joiner while it copies, with ``"paced"``
  every step while its copy lasts, a part behind each;
- a node dies silently, or a worker hangs: nothing closes, so the survivors wait in the
  blocked collective until phi accrual crosses its threshold (``horizon_s``); a hang
  shorter than that evicts nobody; a hung worker that wakes rejoins like a replacement;
- a dropped link: the collective fails, the same members re-form after ``reform_s``
  (``cluster.reform_backoff_ms``);
- a latency spike: steps slow down for its duration (nobody is evicted while the spike is
  shorter than the detection horizon; the planner cannot take a member's last slot);
- a region is lost: as many deaths at once; when the coordinator's region is lost, the
  workers reconnect to the standby, which waits ``takeover_settle_ms``; without a
  standby the run waits for the region; the region's workers rejoin when it is back;
- a NaN part: the bad slot is re-run on another member, a small reduction shares the
  verdicts, the step is recomputed on resampled data.

Limits: spares are not used for a whole region's loss (they replace single deaths);
a spike longer than the detection horizon, which would evict, is not modelled.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from perdure.sim.engine import Context, State, step_time
from perdure.sim.failures import Event
from perdure.sim.policies.common import (
    add_copying,
    add_members,
    copying_in,
    in_lost_region,
    lose_inflight,
    missing,
    pay,
    pay_until,
    set_down,
)


@dataclass(frozen=True)
class Costs:
    """perdure's costs on one deployment (built by :mod:`perdure.sim.scenario`)."""

    close_s: float
    """A closed socket reaching the peers (one-way latency)."""
    reconfigure_s: float
    """Announce, ready, start, new process group: measured, plus the deployment's hops."""
    horizon_s: float
    """Silence until phi accrual declares a worker dead."""
    settle_s: float
    """The standby's settle time after a takeover."""
    replace_after_s: float
    """The launcher's delay before it starts a replacement (once hardware is there)."""
    start_s: float
    """A replacement process's start-up until it can be planned in (measured)."""
    boundary_s: float
    """From a ready joiner to the boundary its epoch starts at (members train on)."""
    salvage: bool
    """The exact reduction keeps the survivors' finished slots."""
    copy_s: float
    """A joiner's state copy when its region has members (holders there and in every
    other region)."""
    far_copy_s: float
    """A joiner's state copy when its region has no member (holders elsewhere only)."""
    overlapped: bool = False
    """``state_copy = "overlapped"``: a joiner copies while the members compute without
    it; false: every member waits for the copy."""
    paced: bool = False
    """``state_copy = "paced"`` (with ``overlapped``): the copy is spread over the steps it
    takes, so no member waits for it."""
    reform_wait_s: float = 0.05
    """After a failed collective with nobody lost, the wait before the same members
    re-form (``cluster.reform_backoff_ms``, the first of a row)."""


def handle(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    """perdure's reaction to one event."""
    c: Costs = ctx.costs
    if in_lost_region(s, e.kind, e.region):
        return s, ()
    if e.kind == "worker_death":
        return _deaths(ctx, s, e, 1, c.close_s)
    if e.kind == "node_death":
        return _deaths(ctx, s, e, e.count, c.horizon_s if e.silent else c.close_s)
    if e.kind == "hang":
        return _hang(ctx, s, e)
    if e.kind == "link_flap":
        s = lose_inflight(s, 0.0 if c.salvage else 1.0)
        return pay(s, detection=c.close_s + c.reform_wait_s, reform=c.reconfigure_s), ()
    if e.kind == "latency_spike":
        end = Event(t=s.t + e.duration_s, kind="spike_end", extra_latency_s=e.extra_latency_s)
        return s._replace(extra_lat_s=s.extra_lat_s + e.extra_latency_s), (end,)
    if e.kind == "spike_end":
        return s._replace(extra_lat_s=max(0.0, s.extra_lat_s - e.extra_latency_s)), ()
    if e.kind == "region_loss":
        return _region_loss(ctx, s, e)
    if e.kind == "region_back":
        return _region_back(ctx, s, e)
    if e.kind == "nan_part":
        verdicts = ctx.step.small_allreduce_s(s.members)
        redo = ctx.step.slot_s + ctx.step.seconds(s.members, s.extra_lat_s)
        return pay(s, detection=verdicts, lost=redo), ()
    if e.kind == "started":
        return s._replace(starting=max(0, s.starting - e.count)), ()
    if e.kind in ("replaced", "resumed"):
        return _arrive(ctx, s, e)
    if e.kind == "copied":
        return _copied(ctx, s, e), ()
    return s, ()


def _lost_fraction(c: Costs, s: State, dead: int) -> float:
    k = sum(s.members)
    return min(1.0, dead / k) if c.salvage and k else 1.0


def _deaths(
    ctx: Context, s: State, e: Event, n: int, detect_s: float
) -> tuple[State, tuple[Event, ...]]:
    """``n`` workers of ``e.region`` are gone for good; replacements come later."""
    c: Costs = ctx.costs
    s = lose_inflight(s, _lost_fraction(c, s, n))
    promoted = min(s.spares, n, s.members[e.region])
    s, later = _promote(ctx, s, e.region, n, promoted, detect_s)
    s, back = _replacements(s, e, n)
    return s, later + back


def _promote(
    ctx: Context, s: State, region: int, n: int, promoted: int, detect_s: float
) -> tuple[State, tuple[Event, ...]]:
    """``n`` members of ``region`` gone, ``promoted`` spares planned into the epoch that
    drops them (:func:`_plan_in`)."""
    c: Costs = ctx.costs
    s = s._replace(spares=s.spares - promoted)
    s = add_members(s, ctx, region, -n)
    return _plan_in(ctx, s, region, promoted, detection=detect_s, reform=c.reconfigure_s)


def _plan_in(
    ctx: Context, s: State, region: int, n: int, **epoch: float
) -> tuple[State, tuple[Event, ...]]:
    """An epoch change (its items: ``epoch``) that plans ``n`` joiners into ``region``,
    each to copy its state from the members that hold it (``copy_s``, or ``far_copy_s``
    when the region has none). Stalled: everyone waits for the copy, then trains with
    the joiners. Overlapped (the runtime's rule, ``runtime/member/copy_overlap.py``): the
    epoch's first step is planned with no slot on a joiner; the members compute it while
    the joiners copy, and its reduction waits for the copy, so that step takes
    ``max(first, copy)`` (``first``: the step time without the joiners); the joiners
    take their slots from the next step on. Paced (``cluster.copy_pace``,
    ``runtime/member/copy_pacing.py``): a part of the copy behind each step's compute, so
    no step waits for it; the joiners take their slots once it is done, ``max(first,
    copy)`` after the epoch starts (the parts' own fixed costs, 23 ms each where a part
    outlasts its step's compute, are left out)."""
    c: Costs = ctx.costs
    if n <= 0:
        return pay(s, **epoch), ()
    copy = c.copy_s if s.members[region] > 0 else c.far_copy_s
    first = step_time(ctx, s)
    if not c.overlapped or not math.isfinite(first):  # no member computes: nothing to overlap
        return pay(add_members(s, ctx, region, n), copy=copy, **epoch), ()
    if c.paced:
        s = add_copying(pay(s, **epoch), region, n)
        return s, (
            Event(t=s.stall_until + max(first, copy), kind="copied", region=region, count=n),
        )
    s = add_copying(pay(s, copy=max(0.0, copy - first), **epoch), region, n)
    return s, (Event(t=s.stall_until + first, kind="copied", region=region, count=n),)


def _copied(ctx: Context, s: State, e: Event) -> State:
    """Overlapped joiners have their state: they take slots; any beyond full strength (a
    replacement planned in meanwhile took the place) refill the spare pool."""
    if s.down and s.down[e.region]:  # the region was lost meanwhile: nobody joins
        return s
    s = add_copying(s, e.region, -e.count)
    room = ctx.target[e.region] - s.members[e.region] - copying_in(s, e.region)
    joining = min(e.count, room)
    back = min(e.count - joining, ctx.spares - s.spares)
    return add_members(s, ctx, e.region, joining)._replace(spares=s.spares + max(0, back))


def _replacements(s: State, e: Event, n: int) -> tuple[State, tuple[Event, ...]]:
    """The failed hardware is back (or replaced) after the failure's own time."""
    return s, (Event(t=s.t + e.replace_s, kind="hardware_back", region=e.region, count=n),)


def _arrive(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    """Replacements (or woken workers) join at a boundary, or refill the spare pool."""
    c: Costs = ctx.costs
    room = ctx.target[e.region] - s.members[e.region] - copying_in(s, e.region)
    joining = min(e.count, missing(s, ctx), room)
    spare = min(e.count - joining, ctx.spares - s.spares)
    s = s._replace(spares=s.spares + max(0, spare))
    if joining <= 0:
        return s, ()
    return _plan_in(ctx, s, e.region, joining, reform=c.reconfigure_s)


def _hang(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    c: Costs = ctx.costs
    if e.duration_s < c.horizon_s:  # nobody is evicted: everyone waits it out
        return pay(s, wait=e.duration_s), ()
    s = lose_inflight(s, _lost_fraction(c, s, 1))
    s, later = _promote(ctx, s, e.region, 1, min(s.spares, 1), c.horizon_s)
    wake_s = e.duration_s + c.boundary_s
    return s, (*later, Event(t=s.t + wake_s, kind="resumed", region=e.region))


def _region_loss(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    c: Costs = ctx.costs
    if s.down[e.region]:
        return s, ()
    detect = c.horizon_s if e.silent else c.close_s
    settle = 0.0
    s = lose_inflight(s, _lost_fraction(c, s, s.members[e.region]))
    s = set_down(add_members(s, ctx, e.region, -ctx.target[e.region]), e.region, True)
    s = add_copying(s, e.region, -copying_in(s, e.region))  # its joiners are lost too
    back = Event(t=s.t + e.duration_s, kind="region_back", region=e.region)
    if e.region == ctx.coordinator and not s.coordinator_lost:
        if ctx.standby is None or s.down[ctx.standby]:
            return _wait_for(s, back), (back,)
        s = s._replace(coordinator_lost=True)
        settle = c.settle_s
    return pay(s, detection=detect, reform=settle + c.reconfigure_s), (back,)


def _wait_for(s: State, back: Event) -> State:
    """No coordinator anywhere: nothing trains until the region is back."""
    return pay_until(s, back.t, "wait")


def _region_back(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    """The region's machines are back: its workers start again and join."""
    s = set_down(s, e.region, False)
    n = ctx.target[e.region] - s.members[e.region]
    return _hardware_back(ctx, s, replace(e, count=n))


def _hardware_back(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    """The launcher waits its delay, starts the process(es); once ready, they join."""
    c: Costs = ctx.costs
    t0 = s.t + c.replace_after_s
    return s, (
        Event(t=t0, kind="launch", count=e.count),
        Event(t=t0 + c.start_s, kind="started", count=e.count),
        Event(
            t=t0 + c.start_s + c.boundary_s,
            kind="replaced",
            region=e.region,
            count=e.count,
        ),
    )


def policy(ctx: Context, s: State, e: Event) -> tuple[State, tuple[Event, ...]]:
    """The handler the engine calls."""
    if e.kind == "hardware_back":
        return _hardware_back(ctx, s, e)
    if e.kind == "launch":
        return s._replace(starting=s.starting + e.count), ()
    return handle(ctx, s, e)


__all__ = ["Costs", "policy"]
