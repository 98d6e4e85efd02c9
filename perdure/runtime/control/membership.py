"""Membership: what admitted workers report, who is dead, and who takes a lost one's place.

A member is declared dead when its connection closes, its heartbeats stop (phi accrual,
``detector.py``), a peer evicts it, or a new process claims its name (``admission.py``);
a member of the running or announced epoch that dies makes the epoch re-form at once
(``after = -1``), with a warm spare in its place where one is ready. A collective failure
with no death to explain it (a dropped link) re-forms the same members after a backoff,
unless it keeps failing. The decisions that need no state are pure functions
(:func:`reform_wait_s`, :func:`pick_spare`); :class:`Membership` applies them.
"""

from __future__ import annotations

from perdure import events as ev
from perdure.runtime.config import ClusterConfig
from perdure.runtime.control import protocol as p
from perdure.runtime.control.boundary import planned_boundary
from perdure.runtime.control.epochs import Epochs
from perdure.runtime.control.events import Disconnect, Received
from perdure.runtime.control.state import Board, Member
from perdure.runtime.shard_plan import NONE

FAIL_SETTLE_S = 0.05
"""After a collective failure, how long to wait for a death that explains it before
re-forming the same members (a dropped link): ``cluster.reform_backoff_ms``'s default,
doubled per failure in a row (see :func:`reform_wait_s`)."""


def reform_wait_s(cluster: ClusterConfig, failures: int) -> float:
    """How long to wait for a death that explains a collective failure before re-forming
    the same members: ``reform_backoff_ms``, doubled per failure in a row, capped."""
    wait_ms = cluster.reform_backoff_ms * 2 ** max(0, failures - 1)
    return min(wait_ms, cluster.reform_backoff_max_ms) / 1000


def pick_spare(spares: list[Member], lost: Member) -> Member | None:
    """The warm spare (prepared) to take ``lost``'s place: one in the same region first,
    then by name; None if no spare is prepared."""
    ready = [w for w in spares if w.prepared]
    ready.sort(key=lambda w: (w.region != lost.region, w.name))
    return ready[0] if ready else None


class Membership:
    """Applies workers' reports and deaths to the board."""

    def __init__(self, board: Board, epochs: Epochs) -> None:
        self.b = board
        self.epochs = epochs
        self.reform_failures = 0
        """Collective failures in a row with no member lost and no step committed."""
        self.last_fail = ""

    def on_received(self, e: Received) -> None:
        b = self.b
        info = b.workers.get(e.worker)
        if info is None or not info.alive:
            return
        info.detector.heartbeat(e.now)
        msg = e.msg
        if isinstance(msg, p.Heartbeat):
            info.next_step = msg.next_step
            b.high_water = max(b.high_water, msg.next_step)
            self._note_progress(info)
            info.prepared = info.prepared or msg.prepared
            if msg.slot_s is not None:
                info.slot_s = msg.slot_s
            if msg.sent is not None and e.wall is not None:
                info.lag.sample(msg.sent, e.wall, e.now)
        elif isinstance(msg, p.Ready):
            info.next_step, info.has_state = msg.next_step, msg.has_state
            if msg.has_state:
                b.high_water = max(b.high_water, msg.next_step)
            info.shard = msg.shard if msg.has_state else NONE
            self.epochs.on_ready(info.name, msg)
        elif isinstance(msg, p.Fail):
            self._on_fail(info, msg, e.now)
        elif isinstance(msg, p.Leave):
            self._on_leave(info)
        elif isinstance(msg, p.Evict):
            target = b.workers.get(msg.worker)
            if target is not None:
                self.declare_dead(target, f"evicted: {msg.reason}")
        elif isinstance(msg, p.Abort):
            b.give_up(msg.reason, worker=info.name)
        elif isinstance(msg, p.Done):
            info.done, info.next_step = True, msg.next_step
            b.log(ev.WORKER_DONE, worker=info.name, final_hash=msg.final_hash, step=msg.next_step)
        # a Hello after admission carries nothing new: ignored

    def _on_fail(self, info: Member, msg: p.Fail, now: float) -> None:
        b = self.b
        b.log(ev.COLLECTIVE_FAILED, worker=info.name, epoch=msg.epoch, error=msg.error)
        if msg.epoch == b.epoch and b.pending is None and b.fail_at is None:
            b.fail_at = now
            self.reform_failures += 1
            self.last_fail = f"{info.name}: {msg.error}"

    def _note_progress(self, info: Member) -> None:
        """A member of the running epoch committed a step: failures are no longer in a row."""
        b = self.b
        if (
            self.reform_failures
            and b.current is not None
            and info.name in b.current.members
            and info.next_step > b.start_step
        ):
            self.reform_failures = 0

    def _on_leave(self, info: Member) -> None:
        """A graceful stop: finish the step in flight, then go on without the worker."""
        b = self.b
        b.log(ev.LEAVE_REQUESTED, worker=info.name)
        info.role = "leaving"
        members = b.members_now()
        if info.name in members:
            after = planned_boundary(b)
            if after >= b.s.config.train.steps:
                return  # the run ends first: it leaves with the run (no epoch past the end)
            spare = self.promote_spare(info)
            rest = [m for m in members if m != info.name] + spare
            stand_ins = {info.name: spare[0]} if spare else None
            self.epochs.announce(
                rest, after=after, reason=f"{info.name} left gracefully", stand_ins=stand_ins
            )

    def maybe_reform(self, now: float) -> bool:
        """A collective failed but nobody died: a link dropped. Re-form the same members
        once the backoff passed, unless they failed too often in a row to be a fault
        rather than a setting. True if it acted (the tick ends there)."""
        b = self.b
        if b.fail_at is None or now - b.fail_at <= reform_wait_s(b.cluster, self.reform_failures):
            return False
        b.fail_at = None
        if self.reform_failures >= b.cluster.max_reform_failures:
            b.give_up(
                f"the data plane failed {self.reform_failures} times in a row with no "
                f"member lost and no step committed; last error: {self.last_fail}"
            )
            return True
        self.epochs.announce(b.members_now(), after=-1, reason="collective failed")
        return True

    def detect(self, now: float) -> None:
        limit = self.b.cluster.phi_threshold
        for info in list(self.b.workers.values()):
            if info.alive and info.detector.phi(now) > limit:
                self.declare_dead(info, f"phi > {limit} (no heartbeat)")

    def declare_dead(self, info: Member, reason: str) -> None:
        if not info.alive:
            return
        b = self.b
        info.alive = False
        b.out.append(Disconnect(info.name))
        b.log(ev.LEAVE, worker=info.name, reason=reason)
        in_current = b.current is not None and info.name in b.current.members
        in_pending = b.pending is not None and info.name in b.pending.members
        if info.role == "leaving" and b.pending is not None and not in_pending:
            return  # its graceful leave is planned: the step in flight is not given up
        if (in_current or in_pending) and not b.finished:
            survivors = [m for m in b.members_now() if m != info.name]
            spare = self.promote_spare(info)
            stand_ins = {info.name: spare[0]} if spare else None
            reason = f"{info.name} left: {reason}"
            self.epochs.announce(survivors + spare, after=-1, reason=reason, stand_ins=stand_ins)

    def promote_spare(self, lost: Member) -> list[str]:
        """A warm spare (imported, admitted, idle) takes the lost member's place at once,
        preferring one in the same region."""
        spare = pick_spare(self.b.alive("spare"), lost)
        if spare is None:
            return []
        spare.role = "worker"
        self.b.log(ev.SPARE_PROMOTED, worker=spare.name, **{"for": lost.name})
        return [spare.name]
