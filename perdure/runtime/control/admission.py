"""Admission: which hello becomes a member, which is refused, and which is told to retry.

A hello is checked in this order: a peer that did not prove the run token is counted,
never logged line by line (``refusals.py``); an authentic hello of a newer generation
fences this coordinator out (``leadership.py``); while this coordinator does not lead,
every hello is told to retry; then a malformed hello, a finished run, a data plane that
the members could not reach, and a name a live member holds are refused. The checks are
pure functions of the hello and what the policy knows (:func:`malformed`,
:func:`unroutable`, :func:`claim`); :class:`Admission` applies them.
"""

from __future__ import annotations

import ipaddress
import math
import re
from dataclasses import dataclass

from perdure import events as ev
from perdure.run_config import to_dict
from perdure.runtime.control import protocol as p
from perdure.runtime.control.detector import PhiAccrual
from perdure.runtime.control.events import Accept, CountRefusal, Joined, Reject
from perdure.runtime.control.leadership import Leadership
from perdure.runtime.control.membership import Membership
from perdure.runtime.control.state import Board, Member, Settings
from perdure.runtime.shard_plan import ALL, NONE

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
"""A worker name: it becomes a log file name and a store key, so plain characters only."""

CLAIM_SILENCE_BEATS = 5
"""A member silent for this many heartbeat intervals gives its name up to a new process
that claims it (:func:`claim`)."""


def malformed(hello: p.Hello, authentic: bool) -> str | None:
    """Why a hello can never be admitted (a wrong token, version, name or role), or None."""
    if not authentic:
        return "bad run token"
    if hello.version != p.PROTOCOL_VERSION:
        return f"protocol version {hello.version}, this coordinator speaks {p.PROTOCOL_VERSION}"
    if not NAME.fullmatch(hello.name):
        return f"worker name {hello.name[:64]!r} must match {NAME.pattern}"
    if hello.role not in ("worker", "spare"):
        return f"role {hello.role[:32]!r} must be worker or spare"
    return None


def loopback(address: str) -> bool:
    """Whether ``address`` (as a worker reports it) is a loopback address; no lookups."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def unroutable(hello: p.Hello, alive: list[Member]) -> str | None:
    """A data plane on a loopback address is reachable from its own host only: mixed
    with members elsewhere, every group formation would fail (and be retried) for
    ever. The worker that would mix them is refused, naming the other."""
    if not hello.address:
        return None
    for w in alive:
        if w.address and loopback(w.address) != loopback(hello.address):
            lo: p.Hello | Member = hello if loopback(hello.address) else w
            other: p.Hello | Member = w if lo is hello else hello
            return (
                f"worker {lo.name} listens for its peers on the loopback address "
                f"{lo.address}, which {other.name} at {other.address} cannot reach: "
                f"start {lo.name} with --host or --interface of its own network address "
                "(and give every worker the coordinator's network address, not "
                "127.0.0.1)"
            )
    return None


@dataclass(frozen=True)
class Claim:
    """The answer to a claim of a name a live member holds: refused (``refusal``, and
    whether to ``retry``), or granted by declaring the holder dead (``evict``: why)."""

    refusal: str | None = None
    retry: bool = False
    evict: str | None = None


def claim(
    hello: p.Hello, old: Member | None, launched_pid: int | None, now: float, heartbeat_ms: float
) -> Claim:
    """A name held by a live member: which process keeps it (see docs/deployment.md).

    The launcher's pid settles it where the launcher recorded one: the process it
    started under the name wins, any other is refused. Otherwise a member that has
    sent nothing for ``CLAIM_SILENCE_BEATS`` heartbeat intervals (a stale process that
    took the name and does not beat, a worker whose old channel hangs) gives way, and
    one that beats keeps it: the newcomer is told to retry (within its join timeout).

    Limit: a peer holding the run token can lie about its pid and beat; only the
    launcher's record tells such a process from the real worker."""
    if old is None or not old.alive:
        return Claim()
    silent = now - (old.detector.last if old.detector.last is not None else -math.inf)
    if launched_pid is not None and hello.pid == launched_pid != old.pid:
        why = f"pid {old.pid} is not the one the launcher started ({launched_pid})"
    elif launched_pid is not None and old.pid == launched_pid != hello.pid:
        return Claim(
            f"worker name {hello.name!r} belongs to pid {old.pid}, the one the launcher "
            f"started; this process (pid {hello.pid}) is not it"
        )
    elif silent > CLAIM_SILENCE_BEATS * heartbeat_ms / 1000:
        why = f"no heartbeat for {silent:.1f} s"
    else:
        in_use = f"worker name {hello.name!r} is in use by pid {old.pid}, which heartbeats"
        return Claim(in_use, retry=True)
    return Claim(evict=f"its name was claimed by pid {hello.pid}: {why}")


def welcome(s: Settings, epoch: int, generation: int) -> p.Welcome:
    """What an admitted worker is told: the run's config and where its state lives."""
    return p.Welcome(
        config=to_dict(s.config),
        run_dir=s.run_dir,
        resume=s.resume,
        store_port=s.store_port,
        epoch=epoch,
        generation=generation,
        allow_config_change=s.allow_config_change,
    )


class Admission:
    """Answers hellos: accept, reject, or tell to retry."""

    def __init__(self, board: Board, leader: Leadership, members: Membership) -> None:
        self.b = board
        self.leader = leader
        self.members = members
        self.waiting: set[str] = set()
        """Names told to retry: their refusal is logged once, not on every retry."""

    def on_joined(self, e: Joined) -> None:
        b, h = self.b, e.hello
        reason = malformed(h, e.authentic)
        if not e.authentic:  # a stranger: counted, not logged line by line
            b.out.append(CountRefusal(e.conn, reason or "bad run token"))
            return
        if reason is None and b.generation > 0 and h.generation > b.generation:
            # Only an authentic hello may fence: a stranger's number must not stop us.
            self.leader.fence(h.generation, f"worker {h.name} follows generation {h.generation}")
        if reason is None and not self.leader.leading:
            self._tell_to_wait(e)
            return
        reason = reason or (p.RUN_OVER if b.finished else unroutable(h, b.alive()))
        verdict = self._claim(e) if reason is None else Claim()
        retry = verdict.retry
        reason = reason or verdict.refusal
        if reason:
            # Logged before the answer: whoever is refused can read why at once (a
            # retried claim once per name, not once per retry).
            if not retry or h.name not in self.waiting:
                flag = {"retry": True} if retry else {}
                b.log(ev.REFUSED, worker=h.name[:64], reason=reason, **flag)
            if retry:
                self.waiting.add(h.name)
            b.out.append(Reject(e.conn, reason, retry=retry))
            return
        self.waiting.discard(h.name)
        self._admit(e)

    def _claim(self, e: Joined) -> Claim:
        b = self.b
        old = b.workers.get(e.hello.name)
        verdict = claim(e.hello, old, e.launched_pid, e.now, b.cluster.heartbeat_ms)
        if verdict.evict is not None and old is not None:
            self.members.declare_dead(old, verdict.evict)
        return verdict

    def _tell_to_wait(self, e: Joined) -> None:
        """Not the coordinator now: the worker retries (another coordinator, or here)."""
        reason = self.leader.wait_reason()
        if e.hello.name not in self.waiting:  # once per worker, not on every retry
            self.waiting.add(e.hello.name)
            self.b.log(ev.REFUSED, worker=e.hello.name[:64], reason=reason, retry=True)
        self.b.out.append(Reject(e.conn, reason, retry=True))

    def _admit(self, e: Joined) -> None:
        b, h, c = self.b, e.hello, self.b.cluster
        detector = PhiAccrual(
            expected_interval_s=c.heartbeat_ms / 1000,
            acceptable_pause_s=c.acceptable_pause_ms / 1000,
        )
        detector.heartbeat(e.now)
        info = Member(h.name, h.region, h.role, detector, h.pid, h.next_step, h.has_state)
        info.address = h.address
        info.shard = ALL if h.has_state else NONE  # corrected by its first ready report
        b.workers[h.name] = info
        b.last_admission = e.now
        # Epoch numbers only grow, across coordinators too: a worker ignores older ones.
        b.epoch = max(b.epoch, h.epoch)
        b.out.append(Accept(e.conn, h.name, welcome(b.s, b.epoch, b.generation)))
        b.log(ev.JOIN, worker=h.name, region=h.region, role=h.role, pid=h.pid)
