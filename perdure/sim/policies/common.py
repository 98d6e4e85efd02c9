"""State transitions every policy is built from. Pure: each returns a new state.

Every stall is *paid* under a name (:data:`ITEMS`), and every step given up is recorded,
so that the engine can say where each failure's time went (``Outcome.ledger``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from perdure.sim.engine import Context, State

ITEMS = {
    "detection": "until the failure is known (a socket's close, a detector, a timeout)",
    "wait": "for hardware, a region, a hung worker (everyone idle)",
    "reform": "a new membership, quorum or process group; a rendezvous",
    "copy": "state copied to a joiner or a promoted spare while the members wait",
    "startup": "every process started again (a restart)",
    "load": "a checkpoint read back (a restart)",
    "lost": "work done and given up: the in-flight step, steps since the checkpoint, "
    "a step recomputed (at the fault-free step time)",
    "reduced": "running below full strength: slower steps or a smaller batch, until the "
    "members are back (charged to the last failure that took members away)",
}
"""The ledger's items (``engine.Outcome.ledger``), each with what it counts."""


def record(s: State, **items: float) -> State:
    """Add ``items`` (seconds by name, or ``lost_steps``) to the current event's bill."""
    return s._replace(spent=s.spent + tuple((k, v) for k, v in items.items() if v))


def lose_inflight(s: State, fraction: float = 1.0) -> State:
    """Drop ``fraction`` of the in-flight step's progress (1: it is redone from scratch)."""
    u = (s.steps - math.floor(s.steps + 1e-9)) * fraction
    s = s._replace(steps=s.steps - u, samples=s.samples - u * s.batch)
    return record(s, lost_steps=u * s.batch)


def pay(s: State, **items: float) -> State:
    """No progress for the sum of ``items`` more (after any stall already under way),
    each recorded under its name (:data:`ITEMS`)."""
    return record(stall(s, sum(items.values())), **items)


def pay_until(s: State, t: float, item: str) -> State:
    """No progress before ``t``; the time this adds is recorded as ``item``."""
    added = max(0.0, t - max(s.stall_until, s.t))
    return record(stall_until(s, t), **{item: added})


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
    """Workers neither training nor copying their state to join."""
    return ctx.workers - sum(s.members) - sum(s.copying)


def add_copying(s: State, region: int, n: int) -> State:
    """``n`` joiners more (negative: fewer) copying their state in ``region``."""
    c = list(s.copying) or [0] * len(s.members)
    c[region] = max(0, c[region] + n)
    return s._replace(copying=tuple(c))


def copying_in(s: State, region: int) -> int:
    return s.copying[region] if s.copying else 0


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
    s2 = s._replace(steps=to, samples=s.samples - (s.steps - to) * s.batch)
    return record(s2, lost_steps=(s.steps - to) * s.batch)


def set_down(s: State, region: int, down: bool) -> State:
    d = list(s.down)
    d[region] = down
    return s._replace(down=tuple(d))


STRIKES_A_WORKER = frozenset(("worker_death", "node_death", "hang"))


def in_lost_region(s: State, kind: str, region: int) -> bool:
    """A worker's or node's failure inside a region already lost changes nothing."""
    return kind in STRIKES_A_WORKER and bool(s.down) and s.down[region]


@dataclass(frozen=True)
class Restart:
    """Every process started again from a checkpoint, by item."""

    startup_s: float
    """Processes, Python, torch (measured)."""
    reform_s: float
    """The rendezvous' messages on the deployment."""
    load_s: float
    """The checkpoint read back from storage."""

    @property
    def total_s(self) -> float:
        return self.startup_s + self.reform_s + self.load_s


def pay_restart(s: State, r: Restart) -> State:
    s = pay(s, startup=r.startup_s, reform=r.reform_s, load=r.load_s)
    return s._replace(restarts=s.restarts + 1)
