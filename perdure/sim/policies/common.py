"""State transitions every policy is built from. Pure: each returns a new state."""

from __future__ import annotations

import math

from perdure.sim.engine import Context, State


def lose_inflight(s: State, fraction: float = 1.0) -> State:
    """Drop ``fraction`` of the in-flight step's progress (1: it is redone from scratch)."""
    u = (s.steps - math.floor(s.steps + 1e-9)) * fraction
    return s._replace(steps=s.steps - u, samples=s.samples - u * s.batch)


def stall(s: State, seconds: float) -> State:
    """No progress for ``seconds`` more (after any stall already under way)."""
    return s._replace(stall_until=max(s.stall_until, s.t) + seconds)


def stall_until(s: State, t: float) -> State:
    return s._replace(stall_until=max(s.stall_until, t))


def add_members(s: State, ctx: Context, region: int, n: int) -> State:
    """``n`` workers more in ``region`` (negative: fewer), within 0 and full strength."""
    members = list(s.members)
    members[region] = min(ctx.target[region], max(0, members[region] + n))
    return s._replace(members=tuple(members))


def missing(s: State, ctx: Context) -> int:
    return ctx.workers - sum(s.members)


def durable_step(ctx: Context, steps: float) -> float:
    """The newest checkpoint a restart can load: the last multiple of the interval whose
    write had finished."""
    if not math.isfinite(ctx.ckpt_every_steps):
        return 0.0
    every = ctx.ckpt_every_steps
    return max(0.0, math.floor((steps - ctx.ckpt_lag_steps) / every) * every)


def rollback(s: State, ctx: Context) -> State:
    """Back to the newest durable checkpoint (every full-batch step since is lost)."""
    to = min(s.steps, durable_step(ctx, s.steps))
    return s._replace(steps=to, samples=s.samples - (s.steps - to) * s.batch)


def set_down(s: State, region: int, down: bool) -> State:
    d = list(s.down)
    d[region] = down
    return s._replace(down=tuple(d))


STRIKES_A_WORKER = frozenset(("worker_death", "node_death", "hang"))


def in_lost_region(s: State, kind: str, region: int) -> bool:
    """A worker's or node's failure inside a region already lost changes nothing."""
    return kind in STRIKES_A_WORKER and bool(s.down) and s.down[region]
