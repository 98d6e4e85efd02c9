"""The coordinator's decisions as a state machine: ``handle(event) -> outbox``.

No sockets, no store, no clock, no randomness: every input is a typed event (a hello, a
message from an admitted worker, a closed connection, a timer tick, a checkpoint lookup's
answer), time arrives inside the events, and every output is a typed effect (send, log,
accept, reject, disconnect, look up a checkpoint, finish) that the server
(``coordinator.py``) carries out (both in ``events.py``). A failed send comes back as a
:class:`Closed` event on a later turn, so a decision never runs inside another one: the
state is always whole between events. ``handle`` mutates only the policy's own state; the
tests drive it with no processes at all.

The policy is a thin loop over its concerns, each in its own file and each sharing one
:class:`~state.Board` (the soft state, rebuilt from the workers' reports by a fresh
policy):

- ``admission.py``: hellos (accept, refuse, retry; a name's claim);
- ``membership.py``: workers' reports, deaths, warm spares, re-forming after a failure;
- ``replan.py``: planned changes at a step boundary (growth, rebalance, bench-out);
- ``epochs.py``: epoch formation (announce, ready, start, the plan);
- ``leadership.py``: the run's lease and the fence (one control plane, never two).
"""

from __future__ import annotations

import math

from perdure import events as ev
from perdure.runtime.control import protocol as p
from perdure.runtime.control.admission import CLAIM_SILENCE_BEATS, NAME, Admission
from perdure.runtime.control.boundary import boundary_margin
from perdure.runtime.control.epochs import Epochs
from perdure.runtime.control.events import (
    Accept,
    AcquireLease,
    CheckpointFound,
    Closed,
    CountRefusal,
    Disconnect,
    DrainRequested,
    Effect,
    EndLease,
    Event,
    FindCheckpoint,
    Finish,
    HoldLease,
    Joined,
    LeaseEffect,
    LeaseGranted,
    LeaseLost,
    LeaseObserved,
    LeaseUnavailable,
    Log,
    PrimaryProbed,
    ProbePrimary,
    Received,
    Reject,
    Send,
    Tick,
    WatchLease,
)
from perdure.runtime.control.leadership import Leadership
from perdure.runtime.control.membership import FAIL_SETTLE_S, Membership
from perdure.runtime.control.replan import Replanner
from perdure.runtime.control.state import Board, Member, Pending, Settings
from perdure.runtime.plan import Plan

__all__ = [
    "CLAIM_SILENCE_BEATS",
    "FAIL_SETTLE_S",
    "NAME",
    "Accept",
    "AcquireLease",
    "CheckpointFound",
    "Closed",
    "CountRefusal",
    "Disconnect",
    "DrainRequested",
    "Effect",
    "EndLease",
    "Event",
    "FindCheckpoint",
    "Finish",
    "HoldLease",
    "Joined",
    "LeaseEffect",
    "LeaseGranted",
    "LeaseLost",
    "LeaseObserved",
    "LeaseUnavailable",
    "Log",
    "Member",
    "Pending",
    "Policy",
    "PrimaryProbed",
    "ProbePrimary",
    "Received",
    "Reject",
    "Send",
    "Settings",
    "Tick",
    "WatchLease",
    "boundary_margin",
]


class Policy:
    """Membership, failure detection, plans and the log's order, for one run."""

    def __init__(self, settings: Settings, now: float, lease_until: float = math.inf) -> None:
        """``lease_until``: when the primary's initial grant runs out (local clock; the
        default, never, is for tests of everything but the lease)."""
        self.b = Board(settings, now)
        self.leader = Leadership(self.b, lease_until)
        self.epochs = Epochs(self.b, now)
        self.members = Membership(self.b, self.epochs)
        self.replan = Replanner(self.b, self.epochs, self.members)
        self.admission = Admission(self.b, self.leader, self.members)
        self.was_leading = self.leader.leading

    def handle(self, event: Event) -> list[Effect]:
        """Apply one event; return what the server must do, in order."""
        b, leader = self.b, self.leader
        b.out = []
        b.now = event.now
        if self.was_leading and not leader.leading and not leader.fenced:
            leader.lapse()  # before anything else: a lapsed coordinator decides nothing
        if isinstance(event, Joined):
            self.admission.on_joined(event)
        elif isinstance(event, Received):
            self.members.on_received(event)
        elif isinstance(event, Closed):
            info = b.workers.get(event.worker)
            if info is not None:
                self.members.declare_dead(info, event.reason)
        elif isinstance(event, Tick):
            self._tick(event.now)
        elif isinstance(event, DrainRequested):
            self._on_drain(event)
        elif isinstance(event, CheckpointFound):
            self.epochs.on_checkpoint(event)
        else:
            leader.on_event(event, self.was_leading)
        self.was_leading = leader.leading
        out, b.out = b.out, []
        return out

    # -- what the server and the tests read ------------------------------------------------

    @property
    def s(self) -> Settings:
        return self.b.s

    @s.setter
    def s(self, settings: Settings) -> None:
        self.b.s = settings

    @property
    def workers(self) -> dict[str, Member]:
        return self.b.workers

    @property
    def current(self) -> Plan | None:
        return self.b.current

    @property
    def pending(self) -> Pending | None:
        return self.b.pending

    @property
    def epoch(self) -> int:
        return self.b.epoch

    @property
    def finished(self) -> bool:
        return self.b.finished

    @property
    def generation(self) -> int:
        return self.b.generation

    @property
    def leading(self) -> bool:
        """This coordinator holds a lease it may act on, now."""
        return self.leader.leading

    @property
    def serving(self) -> bool:
        """What its challenge tells a prober: it leads, or could renew (its store answers)."""
        return self.leader.serving

    @property
    def fenced(self) -> bool:
        return self.leader.fenced

    @property
    def took_over(self) -> bool:
        return self.leader.took_over

    # -- the timer and the run's end -------------------------------------------------------

    def _tick(self, now: float) -> None:
        b, leader = self.b, self.leader
        if leader.fenced:
            return
        if leader.leading:
            leader.keep()
        self.members.detect(now)
        if b.finished or not leader.leading:
            return  # no epochs without the lease
        if b.pending is not None:
            self.epochs.progress(now)
            return
        if self.members.maybe_reform(now):
            return
        if b.current is None:
            self.epochs.maybe_first(now, took_over=leader.took_over, rebuild=leader.rebuild)
            return
        if b.drain is None and not self.replan.maybe_bench(now):
            self.replan.maybe_grow()
            self.replan.maybe_replan(now)
        self._maybe_finish()

    def _maybe_finish(self) -> None:
        b = self.b
        if b.current is None:
            return
        members = [b.workers[m] for m in b.current.members]
        if members and all(m.done for m in members):
            self._end_run(next_step=members[0].next_step)

    def _end_run(self, next_step: int | None) -> None:
        b = self.b
        b.log(ev.RUN_END, next_step=next_step, generation=b.generation)
        b.stop_all("run complete" if b.drain is None else f"run stopped: {b.drain.reason}")

    def _on_drain(self, e: DrainRequested) -> None:
        """An early, clean stop: members finish at a step boundary far enough ahead that
        none has begun it, write the final checkpoint and report done; the run then ends
        as a complete one does. Before any epoch has started there is nothing to
        checkpoint: the run just ends."""
        b = self.b
        if b.finished or b.drain is not None:
            return
        if b.current is None and b.pending is None:
            if b.workers or not b.s.standby:  # an idle standby waits for the primary
                b.log(ev.RUN_DRAINING, reason=e.reason, step=None)
                self._end_run(next_step=None)
            return
        steps = b.s.config.train.steps
        b.drain = p.Drain(step=min(self.replan.boundary(), steps), reason=e.reason)
        b.log(ev.RUN_DRAINING, reason=e.reason, step=b.drain.step)
        for w in b.alive():
            b.send(w.name, b.drain)
