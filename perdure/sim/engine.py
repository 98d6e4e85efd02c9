"""The discrete-event loop: training progress between events, a policy's reaction at each.

Between two events the run is in one state (members per region, extra latency, a stall
until some time), so its progress is linear in time: ``1 / step time`` steps per second
once any stall is over. The loop advances the state to the next event (a failure, a
follow-up a policy scheduled, or a step count being reached), hands the event to the
policy (a pure function ``handle(context, state, event) -> (state, follow-ups)``) and
goes on until the run's time or step budget is spent. Nothing is random here: the
failure history comes in as a list, drawn beforehand from a seeded generator.

Progress is kept as a float: its fractional part is the in-flight step, which a policy
may lose (the streamed exact reduction redoes a step a death interrupts: its slots are in
one accumulator) or keep (the chain and the step form salvage the survivors' slots).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from perdure.sim.failures import Event
from perdure.sim.steptime import StepModel

FAILURES = frozenset(
    ("worker_death", "node_death", "hang", "link_flap", "latency_spike", "region_loss", "nan_part")
)


class State(NamedTuple):
    """What the run is at time ``t`` (a named tuple: immutable, and cheap to copy with
    ``_replace``, which the loop does at every event)."""

    t: float
    steps: float
    """Committed steps plus the in-flight fraction."""
    samples: float
    """Steps weighted by the fraction of the global batch they carried (torchft's steps
    with replica groups missing carry less)."""
    members: tuple[int, ...]
    """Workers training, per region."""
    spares: int = 0
    stall_until: float = 0.0
    """No progress before this time (detection, re-plan, restart, copy)."""
    extra_lat_s: float = 0.0
    """Extra cross-region latency (spikes in progress)."""
    starting: int = 0
    """Processes starting up (they take CPU on a time-shared host)."""
    down: tuple[bool, ...] = ()
    """Regions currently lost."""
    coordinator_lost: bool = False
    restarts: int = 0
    """Times every process restarted."""
    batch: float = 1.0
    """Fraction of the global batch a step carries now."""
    spent: tuple[tuple[str, float], ...] = ()
    """The current event's bill: (item, seconds) pairs a policy recorded
    (``policies.common.pay``), or ``lost_steps``; the loop moves it to the ledger."""
    degraded_by: str = ""
    """The failure kind that last left the run below full strength."""
    copying: tuple[int, ...] = ()
    """Joiners per region planned in but still copying their state (the overlapped copy:
    no slots yet); they are not members, and not missing either."""


@dataclass(frozen=True)
class Context:
    """What a policy reads: the deployment's shape, the step model and its costs."""

    step: StepModel
    target: tuple[int, ...]
    """Workers per region at full strength."""
    workers_per_node: int
    coordinator: int
    standby: int | None
    """Region of the standby coordinator, if any."""
    spares: int
    ckpt_every_steps: float
    """Steps between checkpoints (inf: none)."""
    ckpt_blocking_s: float
    """What one checkpoint blocks the step loop for."""
    ckpt_lag_steps: float
    """Steps after a checkpoint starts until it is durable."""
    costs: Any
    """The policy's own costs (``policies.*.Costs``)."""

    @property
    def workers(self) -> int:
        return sum(self.target)


Handler = Callable[[Context, State, Event], tuple[State, tuple[Event, ...]]]


@dataclass(frozen=True)
class Probe:
    """What one failure cost: time from it to the first step beyond the one in flight
    (``new_s``) and to the first commit after the policy's reaction (``commit_s``)."""

    kind: str
    t: float
    new_s: float | None = None
    commit_s: float | None = None


@dataclass(frozen=True)
class Outcome:
    """A simulated run's totals."""

    elapsed_s: float
    steps: float
    samples: float
    step_s: float
    """Fault-free step time at full strength (no checkpoint): the reference."""
    ideal_step_s: float
    """The step's compute alone, the same for every policy of a deployment."""
    restarts: int
    probes: tuple[Probe, ...] = field(default=())
    ledger: dict[str, dict[str, float]] = field(default_factory=dict)
    """Seconds by failure kind and item (``policies.common.ITEMS``): where the time went."""
    counts: dict[str, int] = field(default_factory=dict)
    """Failures by kind."""
    checkpoint_s: float = 0.0
    """Time the periodic checkpoints blocked the step loop."""

    @property
    def goodput(self) -> float:
        """Effective training time ratio: full-batch steps done x the fault-free step
        time, over the elapsed time."""
        return self.samples * self.step_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def efficiency(self) -> float:
        """Full-batch steps done x the compute-only step time, over the elapsed time:
        goodput times what the fault-free step spends beyond compute (exposed
        communication, runtime overhead, checkpoints); comparable across policies."""
        return self.samples * self.ideal_step_s / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def step_goodput(self) -> float:
        """The same with every committed step counted whole (what the benchmarks
        measure: a span ratio over a fixed number of steps)."""
        return self.steps * self.step_s / self.elapsed_s if self.elapsed_s > 0 else 0.0


def step_time(ctx: Context, s: State) -> float:
    """Seconds per step now, checkpoints amortised; inf when nobody can train."""
    if sum(s.members) == 0:
        return math.inf
    t = ctx.step.seconds(s.members, s.extra_lat_s, s.starting)
    if math.isfinite(ctx.ckpt_every_steps):
        t += ctx.ckpt_blocking_s / ctx.ckpt_every_steps
    return t


def advance(ctx: Context, s: State, t1: float, ledger: Ledger | None = None) -> State:
    start = max(s.t, s.stall_until)
    if t1 <= start:
        return s._replace(t=max(s.t, t1))
    now = step_time(ctx, s)
    ds = (t1 - start) / now
    if ledger is not None and (s.batch < 1.0 or s.members != ctx.target or s.extra_lat_s):
        full = step_time(ctx, s._replace(members=ctx.target, extra_lat_s=0.0))
        lost = (t1 - start) * (1 - s.batch * full / now)
        if lost > 0:
            ledger.add(s.degraded_by or "(none)", "reduced", lost)
    return s._replace(t=t1, steps=s.steps + ds, samples=s.samples + ds * s.batch)


class Ledger:
    """Seconds by failure kind and item, and failures by kind (``Outcome.ledger``)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.items: dict[str, dict[str, float]] = {}
        self.counts: dict[str, int] = {}

    def add(self, cause: str, item: str, seconds: float) -> None:
        row = self.items.setdefault(cause, {})
        row[item] = row.get(item, 0.0) + seconds

    def settle(self, cause: str, s: State) -> State:
        """Move the event's bill to the ledger (lost steps at the fault-free step time)."""
        for item, v in s.spent:
            if item == "lost_steps":
                self.add(cause, "lost", v * self.step_s)
            else:
                self.add(cause, item, v)
        return s._replace(spent=())


def reach_time(ctx: Context, s: State, steps: float) -> float:
    """When progress reaches ``steps`` if nothing happens first."""
    if s.steps >= steps:
        return s.t
    return max(s.t, s.stall_until) + (steps - s.steps) * step_time(ctx, s)


def initial_state(ctx: Context) -> State:
    return State(
        t=0.0,
        steps=0.0,
        samples=0.0,
        members=ctx.target,
        spares=ctx.spares,
        down=tuple(False for _ in ctx.target),
        copying=tuple(0 for _ in ctx.target),
    )


def simulate(
    ctx: Context,
    handle: Handler,
    failures: Iterable[Event],
    *,
    until_s: float | None = None,
    until_steps: float | None = None,
) -> Outcome:
    """Run ``handle`` over ``failures`` until ``until_s`` or ``until_steps``."""
    if (until_s is None) == (until_steps is None):
        raise ValueError("exactly one of until_s, until_steps")
    seq = itertools.count()
    timed: list[tuple[float, int, Event]] = []
    triggers: list[tuple[float, int, Event | int]] = []  # an Event, or a probe's index
    for e in failures:
        _schedule(e, timed, triggers, seq)
    probes: list[dict[str, Any]] = []
    s = initial_state(ctx)
    ledger = Ledger(ctx.step.seconds(ctx.target))
    while True:
        t_time = timed[0][0] if timed else math.inf
        t_trig = reach_time(ctx, s, triggers[0][0]) if triggers else math.inf
        t_stop = until_s if until_s is not None else reach_time(ctx, s, until_steps or 0.0)
        t = min(t_time, t_trig, t_stop)
        if not math.isfinite(t):
            break
        s = advance(ctx, s, t, ledger)
        if t == t_stop:
            if until_steps is not None:
                s = s._replace(steps=until_steps, samples=max(s.samples, 0.0))
            break
        if t_trig <= t_time:
            _fire_trigger(heapq.heappop(triggers), s, timed, probes, seq)
            continue
        _, _, e = heapq.heappop(timed)
        prior = s
        s, follow = handle(ctx, s, e)
        cause = e.cause or e.kind
        s = ledger.settle(cause, s)
        owns = _took_members(prior, s) or not _degraded(ctx, prior)
        if e.kind in FAILURES and _degraded(ctx, s) and owns:
            s = s._replace(degraded_by=cause)
        for f in follow:
            _schedule(replace(f, cause=f.cause or cause), timed, triggers, seq)
        if e.kind in FAILURES:
            ledger.counts[e.kind] = ledger.counts.get(e.kind, 0) + 1
            _add_probe(e, s, prior.steps, triggers, probes, seq)
    return Outcome(
        elapsed_s=s.t,
        steps=math.floor(s.steps + 1e-9),
        samples=s.samples,
        step_s=ctx.step.seconds(ctx.target),
        ideal_step_s=ctx.step.ideal_s,
        restarts=s.restarts,
        probes=tuple(Probe(**p) for p in probes),
        ledger=ledger.items,
        counts=ledger.counts,
        checkpoint_s=_checkpoint_s(ctx, s),
    )


def _degraded(ctx: Context, s: State) -> bool:
    return s.members != ctx.target or s.batch < 1.0 or s.extra_lat_s > 0


def _took_members(before: State, after: State) -> bool:
    """Whether an event took members away or shrank the batch. Such a failure owns the
    time below full strength from then on; any failure owns it when it strikes a run at
    full strength. So a link flap or a latency spike during a region's loss leaves the
    slower steps to the region's loss (the spike's own part of them included)."""
    fewer = any(a < b for a, b in zip(after.members, before.members, strict=True))
    return fewer or after.batch < before.batch


def _checkpoint_s(ctx: Context, s: State) -> float:
    if not math.isfinite(ctx.ckpt_every_steps):
        return 0.0
    return s.steps / ctx.ckpt_every_steps * ctx.ckpt_blocking_s


def _schedule(
    e: Event,
    timed: list[tuple[float, int, Event]],
    triggers: list[tuple[float, int, Event | int]],
    seq: itertools.count,
) -> None:
    if e.after_steps is not None:
        heapq.heappush(triggers, (e.after_steps, next(seq), e))
    else:
        heapq.heappush(timed, (e.t, next(seq), e))


def _fire_trigger(
    item: tuple[float, int, Event | int],
    s: State,
    timed: list[tuple[float, int, Event]],
    probes: list[dict[str, Any]],
    seq: itertools.count,
) -> None:
    _, _, what = item
    if isinstance(what, Event):
        e = replace(what, t=s.t + what.delay_s, after_steps=None)
        heapq.heappush(timed, (e.t, next(seq), e))
        return
    index, key = divmod(what, 2)
    p = probes[index]
    name = "new_s" if key == 0 else "commit_s"
    if p[name] is None:
        p[name] = s.t - p["t"]


def _add_probe(
    e: Event,
    s: State,
    before: float,
    triggers: list[tuple[float, int, Event | int]],
    probes: list[dict[str, Any]],
    seq: itertools.count,
) -> None:
    i = len(probes)
    probes.append({"kind": e.kind, "t": s.t, "new_s": None, "commit_s": None})
    heapq.heappush(triggers, (math.floor(before + 1e-9) + 1, next(seq), 2 * i))
    heapq.heappush(triggers, (math.floor(s.steps + 1e-9) + 1, next(seq), 2 * i + 1))
