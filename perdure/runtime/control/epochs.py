"""Epoch formation: who the members of the next epoch are, where it starts, and its plan.

An epoch change goes through three phases:

1. *announce*: the policy picks the members (chain order) and an ``after`` step, and tells
   every connected worker. ``after = -1`` means now (a member died or failed: the in-flight
   step is abandoned); otherwise members finish step ``after - 1`` first (a join, a
   graceful leave or a re-plan, at a step boundary).
2. *ready*: each member stops stepping and reports its next step and whether it holds
   state.
3. *start*: the start step is the highest next step among members with state (a step that
   completed anywhere is kept), the source of state is the first such member, and the
   receivers are the joiners and any member behind; the plan is published.

The choices are pure functions of their inputs (:func:`usable`, :func:`pick`,
:func:`order`, :func:`shards_complete`, :func:`in_their_places`, :func:`plan_for`,
:func:`first_plan`, :func:`start_of`); :class:`Epochs` applies them to the policy's
:class:`~state.Board`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from perdure import events as ev
from perdure.runtime.config import ClusterConfig, OuterConfig, TrainConfig
from perdure.runtime.control import protocol as p
from perdure.runtime.control.copy_rule import overlaps
from perdure.runtime.control.events import CheckpointFound, FindCheckpoint
from perdure.runtime.control.state import Board, Pending
from perdure.runtime.plan import (
    REDO_MAX_WORK,
    Plan,
    from_counts,
    group_order,
    idle_plan,
    make_plan,
    redo_plan,
)
from perdure.runtime.shard_plan import ALL, NONE
from perdure.runtime.shard_plan import complete as shards_complete_of


def usable(n: int, train: TrainConfig) -> int:
    """How many of ``n`` candidates an epoch takes: at most S (every member computes a
    slot), and a multiple of ``train.shard_degree`` (whole replica groups)."""
    k = train.shard_degree
    return min(n, train.slots) // k * k


def pick(names: list[str], n: int, shard_of: Callable[[str], int], k: int) -> list[str]:
    """``n`` of ``names`` (in chain order) for an epoch: the first ``n``, except that
    with replica groups (``k`` > 1) a worker holding a shard none of them holds takes the
    place of one whose shard another also holds (or that holds none), as far as that
    goes. ``shard_of``: the shard each name holds (``ALL``, ``NONE`` or a rank)."""
    chosen, rest = list(names[:n]), list(names[n:])
    if k == 1 or not rest:
        return chosen
    for j in range(min(k, n)):
        have = [shard_of(m) for m in chosen]
        if ALL in have or j in have:
            continue
        donor = next((m for m in rest if shard_of(m) in (j, ALL)), None)
        spare = [m for m in chosen if have.count(shard_of(m)) > 1 or shard_of(m) == NONE]
        if donor is None or not spare:
            continue
        chosen.remove(spare[-1])
        rest.remove(donor)
        chosen.append(donor)
    return [m for m in names if m in chosen]


def order(
    names: list[str], region_of: Mapping[str, str], cluster: ClusterConfig, k: int
) -> list[str]:
    """The ranks' order: a region's workers adjacent (the chain's hops), and with
    replica groups (``k`` > 1) every group inside one region where the counts allow."""
    regions = [r.name for r in cluster.regions]
    return group_order([(n, region_of[n]) for n in names], regions, k)


def shards_complete(ready: Mapping[str, p.Ready], with_state: list[str], k: int, n: int) -> bool:
    """Whether the members with live state at the start step hold, between them, every
    shard of the optimizer state that ``n`` ranks in groups of ``k`` need."""
    if k == 1:
        return True
    start = max(ready[m].next_step for m in with_state)
    held = [ready[m].shard for m in with_state if ready[m].next_step == start]
    return shards_complete_of(held, k, n)


def in_their_places(
    base: list[str],
    members: list[str],
    stand_ins: Mapping[str, str],
    region_of: Mapping[str, str],
) -> list[str] | None:
    """Each promoted spare in the rank of the member it replaces (``stand_ins``: lost
    member -> spare), and every other member of ``base`` (the newest epoch's) in its own
    rank. So a survivor keeps its slot range (the slots it finished in the abandoned
    attempt are salvaged, not recomputed: only the lost member's range is computed again,
    by the spare) and its replica-group shard (only the spare receives state, not every
    rank after the lost one). Only where every spare is in its lost member's region, so a
    region's ranks stay adjacent, and the same names result; else None (``members`` as
    ordered)."""
    placed = [stand_ins.get(m, m) for m in base]
    home = all(region_of[s] == region_of[m] for m, s in stand_ins.items())
    if not home or sorted(placed) != sorted(members):
        return None
    return placed


def plan_for(pend: Pending, current: Plan | None, slots: int) -> Plan:
    """The new epoch's plan: the announced counts, else the running plan's ranges where
    the members did not change, else an even split of ``slots``."""
    if pend.plan_counts is not None and len(pend.plan_counts) == len(pend.members):
        return from_counts(pend.members, pend.plan_counts)
    if current is not None and list(current.members) == pend.members:
        return Plan(tuple(pend.members), current.ranges)
    return make_plan(pend.members, slots)


def start_of(pend: Pending, with_state: list[str]) -> tuple[int, str, list[str]]:
    """Where an epoch whose members ``with_state`` hold live state starts: the highest
    next step among them, the first such member as the source, and as receivers every
    member without state or behind."""
    ready = pend.ready
    start = max(ready[m].next_step for m in with_state)
    source = next(m for m in with_state if ready[m].next_step == start)
    receivers = [m for m in pend.members if not ready[m].has_state or ready[m].next_step != start]
    return start, source, receivers


def first_plan(
    pend: Pending,
    plan: Plan,
    start: int,
    receivers: list[str],
    train: TrainConfig,
    outer: OuterConfig,
) -> Plan | None:
    """The start step's own plan: where receivers copy state behind it (the copy
    overlaps the first step, ``copy_rule.overlaps``), no slot for them
    (``plan.idle_plan``); else, when the epoch redoes a step that members hold slots of
    finished (a loss mid-step), ``plan.redo_plan``'s; None: ``plan`` for every step. No
    redo with parameters sharded at rest: those ranks salvage nothing."""
    ready = pend.ready
    kept = [
        set(ready[m].kept) if ready[m].next_step == start and m not in receivers else set()
        for m in plan.members
    ]
    # a rotated plan searches up to 5 starts: within the one plan's budget
    rotate = order_free(train, outer) and 5 * plan.slots * len(plan.members) <= REDO_MAX_WORK
    if receivers and overlaps(train, outer):
        small = plan.slots * len(plan.members) <= REDO_MAX_WORK
        return idle_plan(plan, kept, receivers, plan_kept=small, rotate=rotate)
    if train.shard_params or plan.slots * len(plan.members) > REDO_MAX_WORK:
        return None
    if not any(kept):
        return None
    lag = [1 if m in receivers else 0 for m in plan.members]
    first = redo_plan(plan, kept, lag, rotate=rotate)
    return None if first == plan else first


def order_free(train: TrainConfig, outer: OuterConfig) -> bool:
    """Whether a redone step may take a rotated plan (``plan.redo_plan``): the exact
    reduction's sum does not depend on the order it meets the slots (integers); the
    chain's does, and DiLoCo's replicas keep their order."""
    return train.reduction == "exact" and not outer.on


class Epochs:
    """Announces epochs, collects their ready reports and starts them on the board."""

    def __init__(self, board: Board, now: float) -> None:
        self.b = board
        self.started = now

    def announce(
        self,
        names: list[str],
        *,
        after: int,
        reason: str,
        counts: list[int] | None = None,
        stand_ins: dict[str, str] | None = None,
    ) -> None:
        """Announce the next epoch of ``names``. ``stand_ins``: lost member -> the spare
        promoted for it (see :func:`in_their_places`)."""
        b = self.b
        members = self._order(self._pick(self._order(names)))
        if stand_ins:
            members, counts = self._in_their_places(members, stand_ins, counts)
        b.epoch += 1
        b.pending = Pending(b.epoch, members, after, reason, counts, b.now)
        b.log(
            ev.EPOCH_ANNOUNCED,
            epoch=b.epoch,
            members=members,
            after=after,
            reason=reason,
            generation=b.generation,
        )
        notice = p.Announce(epoch=b.epoch, members=members, after=after, generation=b.generation)
        for w in b.alive():
            b.send(w.name, notice)

    def maybe_first(self, now: float, *, took_over: bool, rebuild: bool) -> None:
        """The first epoch: once the expected workers joined (or the join timeout passed);
        after a takeover or a regained lease, once admissions settled."""
        b, c = self.b, self.b.cluster
        workers = b.alive("worker")
        if took_over or rebuild:
            b.progress_unknown = took_over  # the lost members' progress died with them
            settled = now - b.last_admission > c.takeover_settle_ms / 1000
            if workers and settled:
                reason = "takeover" if took_over else "lease regained"
                self.announce([w.name for w in workers], after=-1, reason=reason)
            return
        waited = now - self.started > c.join_timeout_ms / 1000
        if len(workers) >= b.s.expected or (workers and waited):
            self.announce([w.name for w in workers], after=-1, reason="start")

    def on_ready(self, name: str, msg: p.Ready) -> None:
        pend = self.b.pending
        if pend is not None and msg.epoch == pend.epoch and name in pend.members:
            pend.ready[name] = msg

    def on_checkpoint(self, found: CheckpointFound) -> None:
        pend = self.b.pending
        if pend is not None and pend.epoch == found.epoch:
            pend.checkpoint = found

    def progress(self, now: float) -> None:
        """The pending epoch: start it once every member is ready, or announce another."""
        b = self.b
        pend = b.pending
        assert pend is not None
        if not pend.members:
            # Every member is gone: start over with whoever is (or comes back) alive.
            idle = [w.name for w in b.alive() if w.role in ("worker", "benched") and not w.done]
            if len(idle) < b.s.config.train.shard_degree:
                return  # too few for one replica group: wait for replacements
            for name in idle:
                b.workers[name].role = "worker"  # a benched member rather than nobody
            if idle:
                self.announce(idle, after=-1, reason="all members lost")
            return
        if all(m in pend.ready for m in pend.members):
            self._start(pend)
            return
        limit = max(5.0, 4 * b.cluster.min_collective_timeout_ms / 1000)
        if now - pend.announced > limit:
            late = [m for m in pend.members if m not in pend.ready]
            b.log(ev.READY_TIMEOUT, epoch=pend.epoch, late=late)
            ready = [m for m in pend.members if m in pend.ready]
            self.announce(ready, after=-1, reason="ready timeout")

    def _start(self, pend: Pending) -> None:
        b, ready = self.b, pend.ready
        with_state = [m for m in pend.members if ready[m].has_state]
        k = b.s.config.train.shard_degree
        if with_state and not shards_complete(ready, with_state, k, len(pend.members)):
            if self._regroup(pend):
                return
            with_state = []  # a shard of the optimizer state died with its holders
        live = start_of(pend, with_state) if with_state else None
        if live is not None and not (b.progress_unknown or live[0] < b.high_water):
            self._publish(pend, *live, None, recover=False)  # up to date: no checkpoint
            return
        found = self._checkpoint(pend)  # none live, or the live state may be older
        if found is None:
            return  # asked: the answer comes as an event
        if live is not None and (found.path is None or found.step <= live[0]):
            self._publish(pend, *live, None, recover=False)
            return
        older = {} if live is None else {"live_step": live[0]}
        b.log(
            ev.RECOVERED_FROM_CHECKPOINT,
            epoch=pend.epoch,
            checkpoint=found.path,
            start_step=found.step,
            **older,
        )
        self._publish(pend, found.step, pend.members[0], [], found.path, recover=True)

    def _checkpoint(self, pend: Pending) -> CheckpointFound | None:
        """The newest intact checkpoint, once the coordinator found it (asked once)."""
        if pend.checkpoint is None and not pend.asked:
            pend.asked = True
            self.b.out.append(FindCheckpoint(pend.epoch))
        return pend.checkpoint

    def _regroup(self, pend: Pending) -> bool:
        """An epoch whose members lack a shard (a member's update was torn by a death in
        its group): announce another set of the live workers if one holds every shard.
        False: no better set, the caller recovers from a checkpoint."""
        b = self.b
        names = [w.name for w in b.alive() if w.role in ("worker", "benched") and not w.done]
        start = max((r.next_step for r in pend.ready.values() if r.has_state), default=0)
        for m, r in pend.ready.items():  # a member behind holds a stale shard: none
            live = r.has_state and r.next_step == start
            b.workers[m].shard = r.shard if live else NONE
        chosen = self._pick(self._order(names))
        if sorted(chosen) == sorted(pend.members) or not chosen:
            return False
        self.announce(chosen, after=-1, reason="optimizer shard regrouped")
        return True

    def _pick(self, names: list[str]) -> list[str]:
        b = self.b
        train = b.s.config.train
        shard_of = lambda m: b.workers[m].shard  # noqa: E731
        return pick(names, usable(len(names), train), shard_of, train.shard_degree)

    def _order(self, names: list[str]) -> list[str]:
        b = self.b
        regions = {n: b.workers[n].region for n in names}
        return order(names, regions, b.cluster, b.s.config.train.shard_degree)

    def _in_their_places(
        self, members: list[str], stand_ins: dict[str, str], counts: list[int] | None
    ) -> tuple[list[str], list[int] | None]:
        b = self.b
        base = b.pending.members if b.pending else b.current.members if b.current else []
        regions = {m: b.workers[m].region for m in [*stand_ins, *stand_ins.values()]}
        placed = in_their_places(list(base), members, stand_ins, regions)
        if placed is None:
            return members, counts
        if counts is None and b.current is not None and list(base) == list(b.current.members):
            counts = b.current.counts()
        return placed, counts

    def _publish(
        self,
        pend: Pending,
        start: int,
        source: str,
        receivers: list[str],
        reload: str | None,
        *,
        recover: bool,
    ) -> None:
        b = self.b
        train = b.s.config.train
        plan = plan_for(pend, b.current, train.slots)
        outer = b.s.config.outer
        first_p = None if recover else first_plan(pend, plan, start, receivers, train, outer)
        first = first_p.to_dict() if first_p is not None else None
        msg = p.Start(
            epoch=pend.epoch,
            plan=plan.to_dict(),
            start_step=start,
            source=source,
            receivers=receivers,
            recover=recover,
            reload=reload,
            prefix=f"pg/{pend.epoch}/{b.s.instance}/",
            generation=b.generation,
            first=first,
        )
        for m in pend.members:
            b.send(m, msg)
            if b.drain is not None:
                b.send(m, b.drain)  # a joiner or promoted spare must stop there too
            b.workers[m].next_step = start
        k = train.shard_degree
        for i, m in enumerate(plan.members):
            b.workers[m].shard = i % k if k > 1 else ALL
        b.current, b.pending = plan, None
        b.high_water = max(b.high_water, start)
        b.progress_unknown = False
        b.last_replan = b.now
        b.fail_at = None
        b.start_step = start
        b.served = True
        b.log(
            ev.EPOCH_STARTED,
            epoch=pend.epoch,
            start_step=start,
            source=source,
            receivers=receivers,
            plan=plan.to_dict(),
            reason=pend.reason,
            generation=b.generation,
            **({"first": first} if first is not None else {}),
        )
