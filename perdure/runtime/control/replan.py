"""Planned epoch changes at a step boundary: growth, rebalance, bench-out and back.

None of these abandons a step: each is announced for a boundary far enough ahead that no
member has begun it (``boundary.planned_boundary``, which a graceful leave uses too),
except a bench-out, which is announced for now (the lagging link holds every step up).
The rules are pure functions of what the members reported (:func:`speed`,
``boundary.step_s``, :func:`to_bench`, :func:`calm_long_enough`); :class:`Replanner`
applies them to the board.
"""

from __future__ import annotations

import statistics

from perdure import events as ev
from perdure.runtime.config import ClusterConfig
from perdure.runtime.control.boundary import planned_boundary, step_s
from perdure.runtime.control.epochs import Epochs, usable
from perdure.runtime.control.lag import bench_pays, excess_over_peers
from perdure.runtime.control.membership import Membership
from perdure.runtime.control.state import Board, Member
from perdure.runtime.plan import rebalance


def speed(i: int, times: list[float], slow_ratio: float) -> float:
    """1.0 unless member ``i`` takes over ``slow_ratio`` times the median of the others per
    slot; then the ratio of that median to its time (its fair share of the slots)."""
    others = times[:i] + times[i + 1 :]
    base = statistics.median(others)
    return 1.0 if times[i] <= slow_ratio * base else base / times[i]


def to_bench(
    members: list[str], lags: list[float], limit: float, step: float, spares: int
) -> dict[str, float]:
    """Members (worst first) whose lag over the others' median exceeds ``limit`` and
    costs more than the remaining members (or one of ``spares`` warm spares) carrying
    their slots; each with its excess lag. Each is judged against the members that would
    remain, so a region that went silent leaves in one epoch."""
    excess = {m: excess_over_peers(lags, i) for i, m in enumerate(members)}
    out: dict[str, float] = {}
    for name in sorted(members, key=lambda m: (-excess[m], m)):
        left = len(members) - len(out)
        if excess[name] < limit or not bench_pays(step, excess[name], left, spares > 0):
            break
        out[name] = excess[name]
        spares -= 1
    return out


def calm_long_enough(
    w: Member, *, lag_s: float, base: float, limit: float, now: float, hold_s: float
) -> bool:
    """Track a benched member's calm: its lag over the members' median (``base``) under
    half the bench limit resets nothing, at or over it resets the clock. True once it
    stayed calm for ``hold_s``."""
    if lag_s - base >= limit / 2:
        w.calm_since = None
    elif w.calm_since is None:
        w.calm_since = now
    elif now - w.calm_since >= hold_s:
        return True
    return False


class Replanner:
    """Grows, rebalances, benches and unbenches the running epoch's members."""

    def __init__(self, board: Board, epochs: Epochs, members: Membership) -> None:
        self.b = board
        self.epochs = epochs
        self.members = members

    @property
    def cluster(self) -> ClusterConfig:
        return self.b.cluster

    def step_s(self) -> float | None:
        b = self.b
        return step_s(b.current, {m: w.slot_s for m, w in b.workers.items()})

    def boundary(self) -> int:
        return planned_boundary(self.b)

    def before_end(self, after: int) -> bool:
        """Whether a planned epoch change at ``after`` happens before the run's last step.
        One at or past it would start an epoch once the members are done: a member
        planned in then would wait for peers that already reported done (seen: the run
        never ended)."""
        return after < self.b.s.config.train.steps

    def maybe_grow(self) -> None:
        """Admit idle workers (new or returning) at a step boundary, up to the configured
        worker count (and S). Past it, a ready worker becomes a warm spare: the next
        failure is then absorbed by promoting it, with no wait for a process to start."""
        b = self.b
        train = b.s.config.train
        members = set(b.current.members if b.current else ())
        idle = [w for w in b.alive("worker") if w.name not in members and not w.done and w.prepared]
        room = usable(b.s.expected, train) - len(members)
        for w in idle[max(0, room) :]:
            w.role = "spare"
            b.log(ev.BECAME_SPARE, worker=w.name)
        # Whole replica groups only: an idle worker waits for its group's other ranks.
        n = len(members) + min(len(idle), max(0, room))
        take = usable(n, train) - len(members)
        if not idle or take <= 0:
            return
        after = self.boundary()
        if self.before_end(after):
            names = sorted(members | {w.name for w in idle[:take]})
            self.epochs.announce(names, after=after, reason="join")

    def maybe_replan(self, now: float) -> None:
        """Move slots away from slow members (bounded), and back once they recover.

        A member is slow when its seconds per slot exceed ``slow_ratio`` times the median;
        its target share is then proportional to its speed. Re-plans happen at most every
        ``replan_interval_ms`` and move at most ``max_slot_moves`` slots, so noisy timings
        cannot make plans oscillate.
        """
        b, c = self.b, self.cluster
        plan = b.current
        if plan is None or len(plan.members) < 2:
            return
        if now - b.last_replan < c.replan_interval_ms / 1000:
            return
        times = [b.workers[m].slot_s for m in plan.members]
        known = [t for t in times if t is not None]
        if len(known) != len(times):
            return
        speeds = [speed(i, known, c.slow_ratio) for i in range(len(known))]
        new = rebalance(plan, speeds, max_moves=c.max_slot_moves)
        if new.counts() == plan.counts():
            return
        after = self.boundary()
        if self.before_end(after):
            b.last_replan = now
            self.epochs.announce(
                list(plan.members), after=after, reason="rebalance", counts=new.counts()
            )

    def maybe_bench(self, now: float) -> bool:
        """Take the members whose links lag out of the collective (or plan a recovered one
        back in); True if an epoch was announced."""
        b = self.b
        limit = self.cluster.bench_lag_ms / 1000
        if limit <= 0 or b.current is None:
            return False
        interval = self.cluster.heartbeat_ms / 1000
        lags = [b.workers[m].lag.lag_s(now, interval) for m in b.current.members]
        if self._maybe_unbench(now, limit, lags):
            return True
        step = self.step_s()
        if len(b.current.members) < 2 or step is None:
            return False
        spares = sum(1 for w in b.alive("spare") if w.prepared)
        benched = to_bench(list(b.current.members), lags, limit, step, spares)
        if not benched:
            return False
        rest = [m for m in b.current.members if m not in benched]
        stand_ins: dict[str, str] = {}
        for name, lag_s in benched.items():
            info = b.workers[name]
            info.role, info.calm_since = "benched", None
            b.log(ev.MEMBER_BENCHED, worker=name, lag_s=round(lag_s, 3), step_s=round(step, 4))
            spare = self.members.promote_spare(info)
            rest += spare
            if spare:
                stand_ins[name] = spare[0]
        self.epochs.announce(rest, after=-1, reason="bench", stand_ins=stand_ins)
        return True

    def _maybe_unbench(self, now: float, limit: float, lags: list[float]) -> bool:
        """A benched member whose lag (over the members' median) stayed under half the
        bench limit for ``replan_interval_ms`` is planned back in at a boundary, or
        becomes a warm spare if a spare took its place."""
        base = statistics.median(lags) if lags else 0.0
        interval = self.cluster.heartbeat_ms / 1000
        hold_s = self.cluster.replan_interval_ms / 1000
        for w in self.b.alive("benched"):
            lag_s = w.lag.lag_s(now, interval)
            if calm_long_enough(w, lag_s=lag_s, base=base, limit=limit, now=now, hold_s=hold_s):
                return self._unbench(w)
        return False

    def _unbench(self, w: Member) -> bool:
        """Plan ``w`` back in at a boundary, or make it a spare where the members are full.
        A boundary at or past the run's end plans nothing: ``w`` stays benched (idle,
        admitted) and is stopped with the others when the run ends."""
        b = self.b
        assert b.current is not None
        members = list(b.current.members)
        full = len(members) >= min(b.s.config.train.slots, b.s.expected)
        after = self.boundary()
        if not full and not self.before_end(after):
            return False
        b.log(ev.MEMBER_UNBENCHED, worker=w.name)
        if full:
            w.role = "spare"
            b.log(ev.BECAME_SPARE, worker=w.name)
            return False
        w.role = "worker"
        self.epochs.announce([*members, w.name], after=after, reason="unbench")
        return True
