"""The coordinator's decisions as a state machine: ``handle(event) -> outbox``.

No sockets, no store, no clock, no randomness: every input is a typed event (a hello, a
message from an admitted worker, a closed connection, a timer tick, a checkpoint lookup's
answer), time arrives inside the events, and every output is a typed effect (send, log,
accept, reject, disconnect, look up a checkpoint, finish) that the server
(``coordinator.py``) carries out. A failed send comes back as a :class:`Closed` event on a
later turn, so a decision never runs inside another one: the state is always whole between
events. ``handle`` mutates only the policy's own state; the tests drive it with no
processes at all.

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

Soft state only: everything here (who is alive, each worker's next step, whether it holds
state) comes from the workers' hellos, heartbeats and ready reports, so a fresh policy (a
standby's) rebuilds its view from them.

One control plane, never two: the policy coordinates only while it holds the run's lease
(``control/lease.py``), under its *generation*, carried by every welcome, announcement and
start. The lease's I/O happens outside (the server's lease agent); its answers arrive as
events, and the policy decides:

- A primary renews (:class:`HoldLease`) while it coordinates: before its first epoch, and
  while at least one worker is connected. One that reaches no worker stops renewing
  (:class:`WatchLease`), so a standby that does reach them can take over; a worker that
  knocks before then makes it renew again. When its own view of the lease runs out, it
  stops coordinating at once: it drops every worker (they stop stepping and look for a
  coordinator) and refuses hellos with "retry" until it renews.
- A standby takes over only when the primary is known dead: the store shows the lease
  expired, *and* its own probe of the primary's channel gets no answer from a serving
  coordinator (dead, hung, cut off, or unable to reach the store itself). A worker that
  reaches the standby is no such proof: it is told to retry, and goes back to the primary.
  Then it acquires the lease (:class:`AcquireLease`, a compare-and-swap that fails if the
  primary renewed meanwhile) and rebuilds its view from the workers' hellos.
- A coordinator that sees a newer generation (in the store, or in a worker's hello) is
  fenced out: it logs ``coordinator_fenced``, drops its workers and stops, writing nothing
  else.
"""

from __future__ import annotations

import ipaddress
import math
import re
import statistics
from dataclasses import dataclass, field

from perdure import events as ev
from perdure.run_config import RunConfig, to_dict
from perdure.runtime.control import protocol as p
from perdure.runtime.control.boundary import boundary_margin
from perdure.runtime.control.detector import PhiAccrual
from perdure.runtime.control.lag import LinkLag, bench_pays, excess_over_peers
from perdure.runtime.control.lease import LeaseView
from perdure.runtime.plan import (
    REDO_MAX_WORK,
    Plan,
    from_counts,
    group_order,
    make_plan,
    rebalance,
    redo_plan,
)
from perdure.runtime.shard_plan import ALL, NONE
from perdure.runtime.shard_plan import complete as shards_complete

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A worker name: it becomes a log file name and a store key, so plain characters only."""

CLAIM_SILENCE_BEATS = 5
"""A member silent for this many heartbeat intervals gives its name up to a new process
that claims it (``Policy._claim``)."""

FAIL_SETTLE_S = 0.05
"""After a collective failure, how long to wait for a death that explains it before
re-forming the same members (a dropped link): ``cluster.reform_backoff_ms``'s default,
doubled per failure in a row (see ``Policy._reform_wait_s``)."""


def _flag(retry: bool) -> dict[str, bool]:
    return {"retry": True} if retry else {}


# -- events in -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Joined:
    """A connection answered its challenge; ``authentic``: the HMAC checked out."""

    conn: int
    hello: p.Hello
    authentic: bool
    now: float
    launched_pid: int | None = None
    """The pid the launcher started under the hello's name (``control/launched.py``), where
    one recorded it: a name's claim is settled by it (see ``Policy._claim``)."""


@dataclass(frozen=True)
class Received:
    """A message from an admitted worker."""

    worker: str
    msg: p.FromWorker
    now: float
    wall: float | None = None
    """The wall clock at its arrival (heartbeat stamps are the sender's wall clock)."""


@dataclass(frozen=True)
class Closed:
    """An admitted worker's connection ended: closed, a send failed, or it broke the
    protocol."""

    worker: str
    reason: str
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed (the server ticks every few milliseconds)."""

    now: float


@dataclass(frozen=True)
class CheckpointFound:
    """The answer to :class:`FindCheckpoint`: the newest intact checkpoint, if any."""

    epoch: int
    path: str | None
    step: int
    now: float


@dataclass(frozen=True)
class DrainRequested:
    """Someone asked the run to stop early and cleanly (a signal to the coordinator)."""

    reason: str
    now: float


@dataclass(frozen=True)
class LeaseGranted:
    """The lease is ours as ``generation`` (acquired or renewed) until ``until``."""

    generation: int
    until: float
    now: float


@dataclass(frozen=True)
class LeaseObserved:
    """A read of the lease store."""

    view: LeaseView
    now: float


@dataclass(frozen=True)
class LeaseLost:
    """A renewal or an acquisition was refused: the store shows ``view``."""

    view: LeaseView
    now: float


@dataclass(frozen=True)
class LeaseUnavailable:
    """The lease store did not answer (or answered with an error)."""

    error: str
    now: float


@dataclass(frozen=True)
class PrimaryProbed:
    """The standby's probe of the primary's channel: ``serving`` when a coordinator
    answered its challenge as serving; ``detail`` says what happened."""

    serving: bool
    detail: str
    now: float


Event = (
    Joined
    | Received
    | Closed
    | Tick
    | CheckpointFound
    | DrainRequested
    | LeaseGranted
    | LeaseObserved
    | LeaseLost
    | LeaseUnavailable
    | PrimaryProbed
)

# -- effects out -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    to: str
    msg: p.FromCoordinator


@dataclass(frozen=True)
class Log:
    record: dict[str, object]


@dataclass(frozen=True)
class Accept:
    """Bind connection ``conn`` to ``worker`` and send it the welcome."""

    conn: int
    worker: str
    welcome: p.Welcome


@dataclass(frozen=True)
class Reject:
    conn: int
    reason: str
    retry: bool = False
    """Not now rather than never: the worker tries elsewhere and comes back."""


@dataclass(frozen=True)
class Disconnect:
    worker: str


@dataclass(frozen=True)
class CountRefusal:
    """A peer that did not prove the run token was refused: counted, logged once per
    interval with the others (``control/refusals.py``), never a line of its own."""

    conn: int
    reason: str


@dataclass(frozen=True)
class FindCheckpoint:
    """Every replica is lost: where does epoch ``epoch`` start from?"""

    epoch: int


@dataclass(frozen=True)
class Finish:
    """The run is complete: the server may stop."""


@dataclass(frozen=True)
class HoldLease:
    """Renew the lease of ``generation`` now and every quarter TTL."""

    generation: int


@dataclass(frozen=True)
class WatchLease:
    """Stop renewing; read the store now and every quarter TTL."""


@dataclass(frozen=True)
class AcquireLease:
    """Take the lease if the store still shows ``expect``; then hold it."""

    expect: LeaseView


@dataclass(frozen=True)
class ProbePrimary:
    """Try the primary's channel (``channel``, from its lease record, unless the server
    was told another address) and report whether a serving coordinator answers."""

    channel: str


@dataclass(frozen=True)
class EndLease:
    """The run is over under ``generation``: mark it ended in the store."""

    generation: int


LeaseEffect = HoldLease | WatchLease | AcquireLease | ProbePrimary | EndLease

Effect = (
    Send | Log | Accept | Reject | CountRefusal | Disconnect | FindCheckpoint | Finish | LeaseEffect
)

# -- state -----------------------------------------------------------------------------------


@dataclass
class Member:
    """The policy's soft view of one admitted worker."""

    name: str
    region: str
    role: str
    detector: PhiAccrual
    pid: int = 0
    next_step: int = 0
    has_state: bool = False
    slot_s: float | None = None
    alive: bool = True
    done: bool = False
    prepared: bool = False
    """Its trainer is built: it can enter an epoch without making the members wait."""
    address: str = ""
    """Where its data plane listens (its hello's address)."""
    lag: LinkLag = field(default_factory=LinkLag)
    """Its link's latency over its floor, from its heartbeats' stamps."""
    calm_since: float | None = None
    """Benched: since when its link has been back to speed."""
    shard: int = ALL
    """The optimizer shard it holds (``train.shard_degree`` > 1): its rank's in the last
    epoch it started, or what its last ready report said."""


@dataclass
class Pending:
    """An announced membership epoch waiting for its members' ready reports."""

    epoch: int
    members: list[str]
    after: int
    reason: str
    plan_counts: list[int] | None
    announced: float
    ready: dict[str, p.Ready] = field(default_factory=dict)
    checkpoint: CheckpointFound | None = None
    asked: bool = False


@dataclass(frozen=True)
class Settings:
    """What the policy needs from the run's config and the server."""

    config: RunConfig
    run_dir: str
    resume: str | None
    store_port: int
    instance: str
    """This coordinator's random id: store prefixes of its epochs never collide with
    another coordinator's."""
    expected: int
    standby: bool = False
    allow_config_change: bool = False
    """Workers may resume from a checkpoint of another config hash (they record it)."""
    generation: int = 1
    """The generation a primary's lease was granted under before it started serving; a
    standby starts with none (0) and gets one only by taking over."""


class Policy:
    """Membership, failure detection, plans and the log's order, for one run."""

    def __init__(self, settings: Settings, now: float, lease_until: float = math.inf) -> None:
        """``lease_until``: when the primary's initial grant runs out (local clock; the
        default, never, is for tests of everything but the lease)."""
        self.s = settings
        self.cluster = settings.config.cluster
        self.workers: dict[str, Member] = {}
        self.epoch = -1
        self.current: Plan | None = None
        self.pending: Pending | None = None
        self.started = now
        self.last_replan = 0.0
        self.last_admission = 0.0
        self.finished = False
        self.took_over = False
        self.fail_at: float | None = None
        self.reform_failures = 0
        """Collective failures in a row with no member lost and no step committed."""
        self.last_fail = ""
        self.start_step = 0
        self.drain: p.Drain | None = None
        self.out: list[Effect] = []
        self.now = now
        # -- the lease (see the module doc) --
        self.ttl_s = self.cluster.lease_ttl_ms / 1000
        self.generation = 0 if settings.standby else settings.generation
        self.lease_until = -math.inf if settings.standby else lease_until
        self.holding = self.generation > 0
        """The lease agent renews (else it only reads the store)."""
        self.fenced = False
        self.served = False
        """An epoch started under this generation (before that, the lease is kept even
        with no worker connected)."""
        self.rebuild = False
        """The lease lapsed and came back: rebuild the view from hellos, as a standby."""
        self.store_ok = True
        self.view: LeaseView | None = None
        self.seen_live = False
        self.probing = False
        self.last_probe = -math.inf
        self.probe_detail = ""
        self.acquiring = False
        self.primary_channel = ""
        """Where the last holder's channel was (a lease record may vanish with its lease)."""
        self.waiting: set[str] = set()
        self.was_leading = self.leading

    def handle(self, event: Event) -> list[Effect]:
        """Apply one event; return what the server must do, in order."""
        self.out = []
        self.now = event.now
        if self.was_leading and not self.leading and not self.fenced:
            self._lapse()  # before anything else: a lapsed coordinator decides nothing
        if isinstance(event, Joined):
            self._on_joined(event)
        elif isinstance(event, Received):
            self._on_received(event)
        elif isinstance(event, Closed):
            self._on_closed(event)
        elif isinstance(event, Tick):
            self._tick(event.now)
        elif isinstance(event, DrainRequested):
            self._on_drain(event)
        elif isinstance(event, CheckpointFound):
            self._on_checkpoint(event)
        else:
            self._on_lease(event)
        self.was_leading = self.leading
        out, self.out = self.out, []
        return out

    @property
    def leading(self) -> bool:
        """This coordinator holds a lease it may act on, now."""
        return not self.fenced and self.generation > 0 and self.now < self.lease_until

    @property
    def serving(self) -> bool:
        """What its challenge tells a prober: it leads, or could renew (its store answers)."""
        return not self.fenced and self.generation > 0 and (self.leading or self.store_ok)

    # -- helpers ---------------------------------------------------------------------------

    def _log(self, name: str, **fields: object) -> None:
        self.out.append(Log({"event": name, **fields}))

    def _send(self, to: str, msg: p.FromCoordinator) -> None:
        self.out.append(Send(to, msg))

    def _alive(self, role: str | None = None) -> list[Member]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]

    def _members_now(self) -> list[str]:
        """The members of the newest epoch, pending or current, that are alive."""
        base = (
            self.pending.members if self.pending else self.current.members if self.current else ()
        )
        return [m for m in base if self.workers[m].alive]

    # -- admission -------------------------------------------------------------------------

    def _on_joined(self, e: Joined) -> None:
        h = e.hello
        reason = self._malformed(e)
        if not e.authentic:  # a stranger: counted, not logged line by line
            self.out.append(CountRefusal(e.conn, reason or "bad run token"))
            return
        if reason is None and self.generation > 0 and h.generation > self.generation:
            # Only an authentic hello may fence: a stranger's number must not stop us.
            self._fence(h.generation, f"worker {h.name} follows generation {h.generation}")
        if reason is None and not self.leading:
            self._tell_to_wait(e)
            return
        reason = reason or self._refusal(e)
        claim = self._claim(e) if reason is None else None
        retry = claim is not None and claim[1]
        reason = reason or (claim[0] if claim else None)
        if reason:
            # Logged before the answer: whoever is refused can read why at once (a
            # retried claim once per name, not once per retry).
            if not retry or h.name not in self.waiting:
                self._log(ev.REFUSED, worker=h.name[:64], reason=reason, **_flag(retry))
            if retry:
                self.waiting.add(h.name)
            self.out.append(Reject(e.conn, reason, retry=retry))
            return
        self.waiting.discard(h.name)
        self._admit(e)

    def _claim(self, e: Joined) -> tuple[str, bool] | None:
        """A name held by a live member: which process keeps it (see docs/deployment.md).

        The launcher's pid settles it where the launcher recorded one: the process it
        started under the name wins, any other is refused. Otherwise a member that has
        sent nothing for ``CLAIM_SILENCE_BEATS`` heartbeat intervals (a stale process that
        took the name and does not beat, a worker whose old channel hangs) gives way, and
        one that beats keeps it: the newcomer is told to retry (within its join timeout).
        Returns the refusal and whether to retry, or None (the name is free, or freed).

        Limit: a peer holding the run token can lie about its pid and beat; only the
        launcher's record tells such a process from the real worker."""
        h, old = e.hello, self.workers.get(e.hello.name)
        if old is None or not old.alive:
            return None
        silent = e.now - (old.detector.last if old.detector.last is not None else -math.inf)
        limit = CLAIM_SILENCE_BEATS * self.cluster.heartbeat_ms / 1000
        if e.launched_pid is not None and h.pid == e.launched_pid != old.pid:
            why = f"pid {old.pid} is not the one the launcher started ({e.launched_pid})"
        elif e.launched_pid is not None and old.pid == e.launched_pid != h.pid:
            return (
                f"worker name {h.name!r} belongs to pid {old.pid}, the one the launcher "
                f"started; this process (pid {h.pid}) is not it",
                False,
            )
        elif silent > limit:
            why = f"no heartbeat for {silent:.1f} s"
        else:
            return f"worker name {h.name!r} is in use by pid {old.pid}, which heartbeats", True
        self._declare_dead(old, f"its name was claimed by pid {h.pid}: {why}")
        return None

    def _malformed(self, e: Joined) -> str | None:
        h = e.hello
        if not e.authentic:
            return "bad run token"
        if h.version != p.PROTOCOL_VERSION:
            return f"protocol version {h.version}, this coordinator speaks {p.PROTOCOL_VERSION}"
        if not NAME.fullmatch(h.name):
            return f"worker name {h.name[:64]!r} must match {NAME.pattern}"
        if h.role not in ("worker", "spare"):
            return f"role {h.role[:32]!r} must be worker or spare"
        return None

    def _tell_to_wait(self, e: Joined) -> None:
        """Not the coordinator now: the worker retries (another coordinator, or here)."""
        if self.fenced:
            reason = f"fenced out: generation {self.generation} was superseded"
        elif self.generation == 0:
            g = self.view.generation if self.view else 0
            reason = f"standby: the primary holds the run's lease (generation {g})"
        else:
            reason = f"the lease of generation {self.generation} lapsed; renewing it"
            if not self.holding:
                self._hold()  # a worker knocks: worth coordinating again
        if e.hello.name not in self.waiting:  # once per worker, not on every retry
            self.waiting.add(e.hello.name)
            self._log(ev.REFUSED, worker=e.hello.name[:64], reason=reason, retry=True)
        self.out.append(Reject(e.conn, reason, retry=True))

    def _refusal(self, e: Joined) -> str | None:
        h = e.hello
        if self.finished:
            return p.RUN_OVER
        return self._unroutable(h)

    def _unroutable(self, h: p.Hello) -> str | None:
        """A data plane on a loopback address is reachable from its own host only: mixed
        with members elsewhere, every group formation would fail (and be retried) for
        ever. The worker that would mix them is refused, naming the other."""
        if not h.address:
            return None
        for w in self._alive():
            if w.address and _loopback(w.address) != _loopback(h.address):
                lo, other = (h, w) if _loopback(h.address) else (w, h)
                return (
                    f"worker {lo.name} listens for its peers on the loopback address "
                    f"{lo.address}, which {other.name} at {other.address} cannot reach: "
                    f"start {lo.name} with --host or --interface of its own network address "
                    "(and give every worker the coordinator's network address, not "
                    "127.0.0.1)"
                )
        return None

    def _admit(self, e: Joined) -> None:
        h, c = e.hello, self.cluster
        detector = PhiAccrual(
            expected_interval_s=c.heartbeat_ms / 1000,
            acceptable_pause_s=c.acceptable_pause_ms / 1000,
        )
        detector.heartbeat(e.now)
        info = Member(h.name, h.region, h.role, detector, h.pid, h.next_step, h.has_state)
        info.address = h.address
        info.shard = ALL if h.has_state else NONE  # corrected by its first ready report
        self.workers[h.name] = info
        self.last_admission = e.now
        # Epoch numbers only grow, across coordinators too: a worker ignores older ones.
        self.epoch = max(self.epoch, h.epoch)
        welcome = p.Welcome(
            config=to_dict(self.s.config),
            run_dir=self.s.run_dir,
            resume=self.s.resume,
            store_port=self.s.store_port,
            epoch=self.epoch,
            generation=self.generation,
            allow_config_change=self.s.allow_config_change,
        )
        self.out.append(Accept(e.conn, h.name, welcome))
        self._log(ev.JOIN, worker=h.name, region=h.region, role=h.role, pid=h.pid)

    # -- messages --------------------------------------------------------------------------

    def _on_received(self, e: Received) -> None:
        info = self.workers.get(e.worker)
        if info is None or not info.alive:
            return
        info.detector.heartbeat(e.now)
        msg = e.msg
        if isinstance(msg, p.Heartbeat):
            info.next_step = msg.next_step
            self._note_progress(info)
            info.prepared = info.prepared or msg.prepared
            if msg.slot_s is not None:
                info.slot_s = msg.slot_s
            if msg.sent is not None and e.wall is not None:
                info.lag.sample(msg.sent, e.wall, e.now)
        elif isinstance(msg, p.Ready):
            self._on_ready(info, msg)
        elif isinstance(msg, p.Fail):
            self._on_fail(info, msg, e.now)
        elif isinstance(msg, p.Leave):
            self._on_leave(info)
        elif isinstance(msg, p.Evict):
            target = self.workers.get(msg.worker)
            if target is not None:
                self._declare_dead(target, f"evicted: {msg.reason}")
        elif isinstance(msg, p.Abort):
            self._abort(info, msg.reason)
        elif isinstance(msg, p.Done):
            info.done, info.next_step = True, msg.next_step
            self._log(
                ev.WORKER_DONE, worker=info.name, final_hash=msg.final_hash, step=msg.next_step
            )
        # a Hello after admission carries nothing new: ignored

    def _abort(self, info: Member, reason: str) -> None:
        """Stop the run: an error every replica reproduces cannot be absorbed."""
        self._give_up(reason, worker=info.name)

    def _give_up(self, reason: str, worker: str | None = None) -> None:
        if self.finished:
            return
        self._log(ev.RUN_FAILED, worker=worker, reason=reason)
        for w in self._alive():
            self._send(w.name, p.Stop(reason=f"run failed: {reason}"))
        self.finished = True
        self.out += [EndLease(self.generation), Finish()]

    def _on_ready(self, info: Member, msg: p.Ready) -> None:
        info.next_step, info.has_state = msg.next_step, msg.has_state
        info.shard = msg.shard if msg.has_state else NONE
        pend = self.pending
        if pend is not None and msg.epoch == pend.epoch and info.name in pend.members:
            pend.ready[info.name] = msg

    def _on_fail(self, info: Member, msg: p.Fail, now: float) -> None:
        self._log(ev.COLLECTIVE_FAILED, worker=info.name, epoch=msg.epoch, error=msg.error)
        if msg.epoch == self.epoch and self.pending is None and self.fail_at is None:
            self.fail_at = now
            self.reform_failures += 1
            self.last_fail = f"{info.name}: {msg.error}"

    def _reform_wait_s(self) -> float:
        """How long to wait for a death that explains a collective failure before
        re-forming the same members: ``reform_backoff_ms``, doubled per failure in a row."""
        c = self.cluster
        wait_ms = c.reform_backoff_ms * 2 ** max(0, self.reform_failures - 1)
        return min(wait_ms, c.reform_backoff_max_ms) / 1000

    def _note_progress(self, info: Member) -> None:
        """A member of the running epoch committed a step: failures are no longer in a row."""
        if (
            self.reform_failures
            and self.current is not None
            and info.name in self.current.members
            and info.next_step > self.start_step
        ):
            self.reform_failures = 0

    def _on_leave(self, info: Member) -> None:
        """A graceful stop: finish the step in flight, then go on without the worker."""
        self._log(ev.LEAVE_REQUESTED, worker=info.name)
        info.role = "leaving"
        members = self._members_now()
        if info.name in members:
            spare = self._promote_spare(info)
            rest = [m for m in members if m != info.name] + spare
            after = max(self.workers[m].next_step for m in members) + 1
            stand_ins = {info.name: spare[0]} if spare else None
            self._announce(
                rest, after=after, reason=f"{info.name} left gracefully", stand_ins=stand_ins
            )

    def _on_closed(self, e: Closed) -> None:
        info = self.workers.get(e.worker)
        if info is not None:
            self._declare_dead(info, e.reason)

    # -- failures --------------------------------------------------------------------------

    def _detect(self, now: float) -> None:
        limit = self.cluster.phi_threshold
        for info in list(self.workers.values()):
            if info.alive and info.detector.phi(now) > limit:
                self._declare_dead(info, f"phi > {limit} (no heartbeat)")

    def _declare_dead(self, info: Member, reason: str) -> None:
        if not info.alive:
            return
        info.alive = False
        self.out.append(Disconnect(info.name))
        self._log(ev.LEAVE, worker=info.name, reason=reason)
        in_current = self.current is not None and info.name in self.current.members
        in_pending = self.pending is not None and info.name in self.pending.members
        if info.role == "leaving" and self.pending is not None and not in_pending:
            return  # its graceful leave is planned: the step in flight is not given up
        if (in_current or in_pending) and not self.finished:
            survivors = [m for m in self._members_now() if m != info.name]
            spare = self._promote_spare(info)
            stand_ins = {info.name: spare[0]} if spare else None
            reason = f"{info.name} left: {reason}"
            self._announce(survivors + spare, after=-1, reason=reason, stand_ins=stand_ins)

    def _promote_spare(self, lost: Member) -> list[str]:
        """A warm spare (imported, admitted, idle) takes the lost member's place at once,
        preferring one in the same region."""
        ready = [w for w in self._alive("spare") if w.prepared]
        spares = sorted(ready, key=lambda w: (w.region != lost.region, w.name))
        if not spares:
            return []
        spare = spares[0]
        spare.role = "worker"
        self._log(ev.SPARE_PROMOTED, worker=spare.name, **{"for": lost.name})
        return [spare.name]

    # -- the timer -------------------------------------------------------------------------

    def _tick(self, now: float) -> None:
        if self.fenced:
            return
        if self.leading:
            self._keep_lease()
        self._detect(now)
        if self.finished or not self.leading:
            return  # no epochs without the lease
        if self.pending is not None:
            self._progress_pending(now)
            return
        if self.fail_at is not None and now - self.fail_at > self._reform_wait_s():
            # A collective failed but nobody died: a link dropped. Re-form the same members,
            # unless they failed too often in a row to be a fault rather than a setting.
            self.fail_at = None
            if self.reform_failures >= self.cluster.max_reform_failures:
                self._give_up(
                    f"the data plane failed {self.reform_failures} times in a row with no "
                    f"member lost and no step committed; last error: {self.last_fail}"
                )
                return
            self._announce(self._members_now(), after=-1, reason="collective failed")
            return
        if self.current is None:
            self._maybe_first_epoch(now)
            return
        if self.drain is None and not self._maybe_bench(now):
            self._maybe_grow()
            self._maybe_replan(now)
        self._maybe_finish()

    def _maybe_first_epoch(self, now: float) -> None:
        workers = self._alive("worker")
        if self.took_over or self.rebuild:
            settled = now - self.last_admission > self.cluster.takeover_settle_ms / 1000
            if workers and settled:
                reason = "takeover" if self.took_over else "lease regained"
                self._announce([w.name for w in workers], after=-1, reason=reason)
            return
        waited = now - self.started > self.cluster.join_timeout_ms / 1000
        if len(workers) >= self.s.expected or (workers and waited):
            self._announce([w.name for w in workers], after=-1, reason="start")

    def _maybe_grow(self) -> None:
        """Admit idle workers (new or returning) at a step boundary, up to the configured
        worker count (and S). Past it, a ready worker becomes a warm spare: the next
        failure is then absorbed by promoting it, with no wait for a process to start."""
        members = set(self.current.members if self.current else ())
        idle = [
            w for w in self._alive("worker") if w.name not in members and not w.done and w.prepared
        ]
        room = self._usable(self.s.expected) - len(members)
        for w in idle[max(0, room) :]:
            w.role = "spare"
            self._log(ev.BECAME_SPARE, worker=w.name)
        # Whole replica groups only: an idle worker waits for its group's other ranks.
        take = self._usable(len(members) + min(len(idle), max(0, room))) - len(members)
        if not idle or take <= 0:
            return
        after = self._boundary()
        if self._before_end(after):
            names = sorted(members | {w.name for w in idle[:take]})
            self._announce(names, after=after, reason="join")

    def _maybe_replan(self, now: float) -> None:
        """Move slots away from slow members (bounded), and back once they recover.

        A member is slow when its seconds per slot exceed ``slow_ratio`` times the median;
        its target share is then proportional to its speed. Re-plans happen at most every
        ``replan_interval_ms`` and move at most ``max_slot_moves`` slots, so noisy timings
        cannot make plans oscillate.
        """
        plan, c = self.current, self.cluster
        if plan is None or len(plan.members) < 2:
            return
        if now - self.last_replan < c.replan_interval_ms / 1000:
            return
        times = [self.workers[m].slot_s for m in plan.members]
        known = [t for t in times if t is not None]
        if len(known) != len(times):
            return
        speeds = [_speed(i, known, c.slow_ratio) for i in range(len(known))]
        new = rebalance(plan, speeds, max_moves=c.max_slot_moves)
        if new.counts() == plan.counts():
            return
        after = self._boundary()
        if self._before_end(after):
            self.last_replan = now
            self._announce(list(plan.members), after=after, reason="rebalance", counts=new.counts())

    # -- bench-out -------------------------------------------------------------------------

    def _lags(self, now: float) -> list[float]:
        """The current members' link lags, in plan order."""
        assert self.current is not None
        interval = self.cluster.heartbeat_ms / 1000
        return [self.workers[m].lag.lag_s(now, interval) for m in self.current.members]

    def _maybe_bench(self, now: float) -> bool:
        """Take the members whose links lag out of the collective (or plan a recovered one
        back in); True if an epoch was announced. Each is judged against the members that
        would remain (``_to_bench``), so a region that went silent leaves in one epoch."""
        limit = self.cluster.bench_lag_ms / 1000
        if limit <= 0 or self.current is None:
            return False
        lags = self._lags(now)  # once a tick, for both directions
        if self._maybe_unbench(now, limit, lags):
            return True
        step_s = self._step_s()
        if len(self.current.members) < 2 or step_s is None:
            return False
        benched = self._to_bench(lags, limit, step_s)
        if not benched:
            return False
        rest = [m for m in self.current.members if m not in benched]
        stand_ins: dict[str, str] = {}
        for name, lag_s in benched.items():
            info = self.workers[name]
            info.role, info.calm_since = "benched", None
            self._log(ev.MEMBER_BENCHED, worker=name, lag_s=round(lag_s, 3),
                      step_s=round(step_s, 4))  # fmt: skip
            spare = self._promote_spare(info)
            rest += spare
            if spare:
                stand_ins[name] = spare[0]
        self._announce(rest, after=-1, reason="bench", stand_ins=stand_ins)
        return True

    def _to_bench(self, lags: list[float], limit: float, step_s: float) -> dict[str, float]:
        """Members (worst first) whose lag over the others' median exceeds ``limit`` and
        costs more than the remaining members (or a warm spare) carrying their slots."""
        assert self.current is not None
        members = list(self.current.members)
        excess = {m: excess_over_peers(lags, i) for i, m in enumerate(members)}
        spares = sum(1 for w in self._alive("spare") if w.prepared)
        out: dict[str, float] = {}
        for name in sorted(members, key=lambda m: (-excess[m], m)):
            left = len(members) - len(out)
            if excess[name] < limit or not bench_pays(step_s, excess[name], left, spares > 0):
                break
            out[name] = excess[name]
            spares -= 1
        return out

    def _maybe_unbench(self, now: float, limit: float, lags: list[float]) -> bool:
        """A benched member whose lag (over the members' median) stayed under half the
        bench limit for ``replan_interval_ms`` is planned back in at a boundary, or
        becomes a warm spare if a spare took its place."""
        base = statistics.median(lags) if lags else 0.0
        interval = self.cluster.heartbeat_ms / 1000
        for w in self._alive("benched"):
            if w.lag.lag_s(now, interval) - base >= limit / 2:
                w.calm_since = None
            elif w.calm_since is None:
                w.calm_since = now
            elif now - w.calm_since >= self.cluster.replan_interval_ms / 1000:
                return self._unbench(w)
        return False

    def _unbench(self, w: Member) -> bool:
        """Plan ``w`` back in at a boundary, or make it a spare where the members are full.
        A boundary at or past the run's end plans nothing: ``w`` stays benched (idle,
        admitted) and is stopped with the others when the run ends."""
        assert self.current is not None
        members = list(self.current.members)
        full = len(members) >= min(self.s.config.train.slots, self.s.expected)
        after = self._boundary()
        if not full and not self._before_end(after):
            return False
        self._log(ev.MEMBER_UNBENCHED, worker=w.name)
        if full:
            w.role = "spare"
            self._log(ev.BECAME_SPARE, worker=w.name)
            return False
        w.role = "worker"
        self._announce([*members, w.name], after=after, reason="unbench")
        return True

    def _before_end(self, after: int) -> bool:
        """Whether a planned epoch change at ``after`` happens before the run's last step.
        One at or past it would start an epoch once the members are done: a member
        planned in then would wait for peers that already reported done (seen: the run
        never ended)."""
        return after < self.s.config.train.steps

    def _boundary(self) -> int:
        """The first step of a planned (not failure-driven) epoch change: far enough ahead
        that no member has started it when the notice arrives. Heartbeats report a member's
        step up to a heartbeat interval late, and a member that has begun step ``after``
        must abandon it; with steps shorter than a heartbeat, ``last + 1`` meant one
        abandoned step per join."""
        members = self.current.members if self.current else ()
        last = max((self.workers[m].next_step for m in members), default=0)
        return last + 1 + boundary_margin(self._step_s(), self.cluster.heartbeat_ms / 1000)

    def _step_s(self) -> float | None:
        """The slowest member's step time, from its reported per-slot time."""
        plan = self.current
        if plan is None:
            return None
        times = []
        for r, m in enumerate(plan.members):
            slot_s = self.workers[m].slot_s
            if slot_s is None:
                return None
            times.append(slot_s * len(plan.slots_of(r)))
        return max(times, default=None)

    def _maybe_finish(self) -> None:
        if self.current is None:
            return
        members = [self.workers[m] for m in self.current.members]
        if members and all(m.done for m in members):
            self._end_run(next_step=members[0].next_step)

    def _end_run(self, next_step: int | None) -> None:
        self._log(ev.RUN_END, next_step=next_step, generation=self.generation)
        reason = "run complete" if self.drain is None else f"run stopped: {self.drain.reason}"
        for w in self._alive():
            self._send(w.name, p.Stop(reason=reason))
        self.finished = True
        self.out += [EndLease(self.generation), Finish()]

    # -- an early, clean stop --------------------------------------------------------------

    def _on_drain(self, e: DrainRequested) -> None:
        """Members finish at a step boundary far enough ahead that none has begun it, write
        the final checkpoint and report done; the run then ends as a complete one does.
        Before any epoch has started there is nothing to checkpoint: the run just ends."""
        if self.finished or self.drain is not None:
            return
        if self.current is None and self.pending is None:
            if self.workers or not self.s.standby:  # an idle standby waits for the primary
                self._log(ev.RUN_DRAINING, reason=e.reason, step=None)
                self._end_run(next_step=None)
            return
        self.drain = p.Drain(step=min(self._boundary(), self.s.config.train.steps), reason=e.reason)
        self._log(ev.RUN_DRAINING, reason=e.reason, step=self.drain.step)
        for w in self._alive():
            self._send(w.name, self.drain)

    # -- epochs ----------------------------------------------------------------------------

    def _announce(
        self,
        names: list[str],
        *,
        after: int,
        reason: str,
        counts: list[int] | None = None,
        stand_ins: dict[str, str] | None = None,
    ) -> None:
        """Announce the next epoch of ``names``. ``stand_ins``: lost member -> the spare
        promoted for it (see :meth:`_in_their_places`)."""
        members = self._order(self._pick(self._order(names), self._usable(len(names))))
        if stand_ins:
            members, counts = self._in_their_places(members, stand_ins, counts)
        self.epoch += 1
        self.pending = Pending(self.epoch, members, after, reason, counts, self.now)
        self._log(
            ev.EPOCH_ANNOUNCED,
            epoch=self.epoch,
            members=members,
            after=after,
            reason=reason,
            generation=self.generation,
        )
        notice = p.Announce(
            epoch=self.epoch, members=members, after=after, generation=self.generation
        )
        for w in self._alive():
            self._send(w.name, notice)

    def _in_their_places(
        self, members: list[str], stand_ins: dict[str, str], counts: list[int] | None
    ) -> tuple[list[str], list[int] | None]:
        """Each promoted spare in the rank of the member it replaces, and every other
        member in its own rank, with the slot ranges of the epoch now. So a survivor keeps
        its slot range (the slots it finished in the abandoned attempt are salvaged, not
        recomputed: only the lost member's range is computed again, by the spare) and its
        replica-group shard (only the spare receives state, not every rank after the lost
        one). Only where every spare is in its lost member's region, so a region's ranks
        stay adjacent; else ``members`` as ordered."""
        base = (
            self.pending.members if self.pending else self.current.members if self.current else []
        )
        placed = [stand_ins.get(m, m) for m in base]
        home = all(self.workers[s].region == self.workers[m].region for m, s in stand_ins.items())
        if not home or sorted(placed) != sorted(members):
            return members, counts
        if counts is None and self.current is not None and list(base) == list(self.current.members):
            counts = self.current.counts()
        return placed, counts

    def _progress_pending(self, now: float) -> None:
        pend = self.pending
        assert pend is not None
        if not pend.members:
            # Every member is gone: start over with whoever is (or comes back) alive.
            idle = [w.name for w in self._alive() if w.role in ("worker", "benched") and not w.done]
            if len(idle) < self.s.config.train.shard_degree:
                return  # too few for one replica group: wait for replacements
            for name in idle:
                self.workers[name].role = "worker"  # a benched member rather than nobody
            if idle:
                self._announce(idle, after=-1, reason="all members lost")
            return
        if all(m in pend.ready for m in pend.members):
            self._start(pend)
            return
        limit = max(5.0, 4 * self.cluster.min_collective_timeout_ms / 1000)
        if now - pend.announced > limit:
            late = [m for m in pend.members if m not in pend.ready]
            self._log(ev.READY_TIMEOUT, epoch=pend.epoch, late=late)
            ready = [m for m in pend.members if m in pend.ready]
            self._announce(ready, after=-1, reason="ready timeout")

    def _start(self, pend: Pending) -> None:
        ready = pend.ready
        with_state = [m for m in pend.members if ready[m].has_state]
        reload: str | None = None
        if with_state and not self._shards_complete(pend, with_state):
            if self._regroup(pend):
                return
            with_state = []  # a shard of the optimizer state died with its holders
        if with_state:
            start = max(ready[m].next_step for m in with_state)
            source = next(m for m in with_state if ready[m].next_step == start)
            receivers = [
                m for m in pend.members if not ready[m].has_state or ready[m].next_step != start
            ]
        else:
            found = pend.checkpoint
            if found is None:
                if not pend.asked:
                    pend.asked = True
                    self.out.append(FindCheckpoint(pend.epoch))
                return
            reload, start = found.path, found.step
            source, receivers = pend.members[0], []
            self._log(
                ev.RECOVERED_FROM_CHECKPOINT, epoch=pend.epoch, checkpoint=reload, start_step=start
            )
        self._publish(pend, start, source, receivers, reload, recover=not with_state)

    def _usable(self, n: int) -> int:
        """How many of ``n`` candidates an epoch takes: at most S (every member computes a
        slot), and a multiple of ``train.shard_degree`` (whole replica groups)."""
        k = self.s.config.train.shard_degree
        return min(n, self.s.config.train.slots) // k * k

    def _pick(self, names: list[str], n: int) -> list[str]:
        """``n`` of ``names`` (in chain order) for an epoch: the first ``n``, except that
        with replica groups a worker holding a shard none of them holds takes the place of
        one whose shard another also holds (or that holds none), as far as that goes."""
        k = self.s.config.train.shard_degree
        chosen, rest = list(names[:n]), list(names[n:])
        if k == 1 or not rest:
            return chosen
        held = lambda m: self.workers[m].shard  # noqa: E731
        for j in range(min(k, n)):
            have = [held(m) for m in chosen]
            if ALL in have or j in have:
                continue
            donor = next((m for m in rest if held(m) in (j, ALL)), None)
            spare = [m for m in chosen if have.count(held(m)) > 1 or held(m) == NONE]
            if donor is None or not spare:
                continue
            chosen.remove(spare[-1])
            rest.remove(donor)
            chosen.append(donor)
        return [m for m in names if m in chosen]

    def _regroup(self, pend: Pending) -> bool:
        """An epoch whose members lack a shard (a member's update was torn by a death in
        its group): announce another set of the live workers if one holds every shard.
        False: no better set, the caller recovers from a checkpoint."""
        names = [w.name for w in self._alive() if w.role in ("worker", "benched") and not w.done]
        start = max((r.next_step for r in pend.ready.values() if r.has_state), default=0)
        for m, r in pend.ready.items():  # a member behind holds a stale shard: none
            live = r.has_state and r.next_step == start
            self.workers[m].shard = r.shard if live else NONE
        pick = self._pick(self._order(names), self._usable(len(names)))
        if sorted(pick) == sorted(pend.members) or not pick:
            return False
        self._announce(pick, after=-1, reason="optimizer shard regrouped")
        return True

    def _order(self, names: list[str]) -> list[str]:
        """The ranks' order: a region's workers adjacent (the chain's hops), and with
        replica groups every group inside one region where the counts allow."""
        regions = [r.name for r in self.cluster.regions]
        k = self.s.config.train.shard_degree
        return group_order([(n, self.workers[n].region) for n in names], regions, k)

    def _shards_complete(self, pend: Pending, with_state: list[str]) -> bool:
        """Whether the members with live state at the start step hold, between them, every
        shard of the optimizer state that the new plan's ranks need."""
        k = self.s.config.train.shard_degree
        if k == 1:
            return True
        start = max(pend.ready[m].next_step for m in with_state)
        held = [pend.ready[m].shard for m in with_state if pend.ready[m].next_step == start]
        return shards_complete(held, k, len(pend.members))

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
        plan = self._plan(pend)
        first_plan = None if recover else self._first_plan(pend, plan, start, receivers)
        first = first_plan.to_dict() if first_plan is not None else None
        msg = p.Start(
            epoch=pend.epoch,
            plan=plan.to_dict(),
            start_step=start,
            source=source,
            receivers=receivers,
            recover=recover,
            reload=reload,
            prefix=f"pg/{pend.epoch}/{self.s.instance}/",
            generation=self.generation,
            first=first,
        )
        for m in pend.members:
            self._send(m, msg)
            if self.drain is not None:
                self._send(m, self.drain)  # a joiner or promoted spare must stop there too
            self.workers[m].next_step = start
        k = self.s.config.train.shard_degree
        for i, m in enumerate(plan.members):
            self.workers[m].shard = i % k if k > 1 else ALL
        self.current, self.pending = plan, None
        self.last_replan = self.now
        self.fail_at = None
        self.start_step = start
        self.served = True
        self._log(
            ev.EPOCH_STARTED,
            epoch=pend.epoch,
            start_step=start,
            source=source,
            receivers=receivers,
            plan=plan.to_dict(),
            reason=pend.reason,
            generation=self.generation,
            **({"first": first} if first is not None else {}),
        )

    def _first_plan(
        self, pend: Pending, plan: Plan, start: int, receivers: list[str]
    ) -> Plan | None:
        """The start step's own plan, when the epoch redoes a step that members hold
        slots of finished (a loss mid-step; ``plan.redo_plan``); None: ``plan`` for every
        step. Not with parameters sharded at rest: those ranks salvage nothing."""
        if self.s.config.train.shard_params or plan.slots * len(plan.members) > REDO_MAX_WORK:
            return None
        ready = pend.ready
        kept = [
            set(ready[m].kept) if ready[m].next_step == start and m not in receivers else set()
            for m in plan.members
        ]
        if not any(kept):
            return None
        lag = [1 if m in receivers else 0 for m in plan.members]
        first = redo_plan(plan, kept, lag)
        return None if first == plan else first

    # -- the lease -------------------------------------------------------------------------

    def _hold(self) -> None:
        self.holding = True
        self.out.append(HoldLease(self.generation))

    def _keep_lease(self) -> None:
        """Renew while coordinating: before the first epoch of this generation, or with a
        worker connected. A coordinator that reaches nobody lets its lease run out."""
        wants = not self.served or bool(self._alive())
        if wants and not self.holding:
            self._hold()
        elif not wants and self.holding:
            self.holding = False
            self.out.append(WatchLease())

    def _lapse(self) -> None:
        """The lease ran out (local view): stop coordinating before anyone can take over.
        Every worker is dropped, so it stops stepping and looks for a coordinator."""
        dropped = [w.name for w in self._alive()]
        self._log(ev.LEASE_LAPSED, generation=self.generation, workers=dropped)
        for name in dropped:
            self.workers[name].alive = False
            self.out.append(Disconnect(name))
        self.current, self.pending, self.fail_at = None, None, None
        self.rebuild, self.served = True, False

    def _fence(self, newer: int, why: str) -> None:
        """A newer generation exists: drop every worker (they find its holder) and stop.
        The fencing record is the last thing this coordinator writes."""
        if self.fenced:
            return
        self.fenced, self.finished = True, True
        self._log(ev.COORDINATOR_FENCED, generation=self.generation, newer=newer, reason=why)
        for w in self._alive():
            w.alive = False
            self.out.append(Disconnect(w.name))
        self.current, self.pending = None, None
        self.out.append(Finish())

    def _on_lease(
        self, e: LeaseGranted | LeaseObserved | LeaseLost | LeaseUnavailable | PrimaryProbed
    ) -> None:
        if self.fenced:
            return
        if isinstance(e, LeaseUnavailable):
            if self.store_ok:
                self._log(ev.LEASE_UNAVAILABLE, generation=self.generation, error=e.error)
            self.store_ok, self.acquiring = False, False
            return
        if isinstance(e, PrimaryProbed):
            self._on_probe(e)
            return
        self.store_ok = True
        if isinstance(e, LeaseGranted):
            self._on_granted(e)
            return
        self.view = e.view
        self.seen_live = self.seen_live or e.view.live
        self.primary_channel = str(e.view.holder.get("channel") or self.primary_channel)
        if isinstance(e, LeaseLost):
            self.acquiring = False
        if self.generation > 0 and e.view.generation > self.generation:
            self._fence(e.view.generation, "the lease store holds a newer generation")
        elif self.generation == 0 and isinstance(e, LeaseObserved):
            self._watch_primary(e.view)

    def _watch_primary(self, view: LeaseView) -> None:
        """A standby's turn: the run ended (stop too), or the lease expired (probe)."""
        if view.state == "ended" and self.seen_live:
            self.finished = True  # the run ended under the primary: nothing to stand by for
            self.out.append(Finish())
        elif (
            view.state == "held"
            and not view.live
            and not (self.probing or self.acquiring)
            and self.now - self.last_probe >= self.ttl_s / 2
        ):
            self.probing = True
            self.out.append(ProbePrimary(self.primary_channel))

    def _on_probe(self, e: PrimaryProbed) -> None:
        self.probing, self.last_probe = False, e.now
        view = self.view
        if e.serving or view is None or view.live or self.generation > 0 or self.acquiring:
            return
        self.acquiring, self.probe_detail = True, e.detail
        self.out.append(AcquireLease(view))

    def _on_granted(self, e: LeaseGranted) -> None:
        if e.generation < self.generation:
            return  # an answer to an older request
        if e.generation > self.generation:
            previous = self.view.generation if self.view else self.generation
            self.generation, self.acquiring, self.holding = e.generation, False, True
            self.served, self.took_over = False, True
            self._log(
                ev.COORDINATOR_TAKEOVER,
                by="standby",
                generation=e.generation,
                previous=previous,
                probe=self.probe_detail,
            )
        elif not self.was_leading:
            self._log(ev.LEASE_REGAINED, generation=self.generation)
        self.lease_until = e.until

    def _on_checkpoint(self, e: CheckpointFound) -> None:
        pend = self.pending
        if pend is not None and pend.epoch == e.epoch:
            pend.checkpoint = e

    def _plan(self, pend: Pending) -> Plan:
        S = self.s.config.train.slots
        if pend.plan_counts is not None and len(pend.plan_counts) == len(pend.members):
            return from_counts(pend.members, pend.plan_counts)
        if self.current is not None and list(self.current.members) == pend.members:
            return Plan(tuple(pend.members), self.current.ranges)
        return make_plan(pend.members, S)


def _loopback(address: str) -> bool:
    """Whether ``address`` (as a worker reports it) is a loopback address; no lookups."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def _speed(i: int, times: list[float], slow_ratio: float) -> float:
    """1.0 unless member ``i`` takes over ``slow_ratio`` times the median of the others per
    slot; then the ratio of that median to its time (its fair share of the slots)."""
    others = times[:i] + times[i + 1 :]
    base = statistics.median(others)
    return 1.0 if times[i] <= slow_ratio * base else base / times[i]
