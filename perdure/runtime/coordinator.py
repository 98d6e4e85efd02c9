"""The coordinator: admission, failure detection, membership epochs, plans, the event log.

Soft state only: everything it knows (who is alive, each worker's next step, whether it
holds state) comes from the workers' hellos, heartbeats and ready reports, so a fresh
coordinator rebuilds its view from them. It is off the hot path: workers step without
talking to it; they hear from it only when a membership epoch changes.

An epoch change goes through three phases:

1. *announce*: the coordinator picks the members (chain order) and an ``after`` step, and
   tells every connected worker. ``after = -1`` means now (a member died or failed: the
   in-flight step is abandoned); otherwise members finish step ``after`` first (a join or
   a re-plan, at a step boundary).
2. *ready*: each member stops stepping and reports its next step and whether it holds
   state.
3. *start*: the coordinator picks the start step (the highest next step among members
   with state: a step that completed anywhere is kept), the source of state and the
   receivers (joiners and any member behind), and publishes the plan.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import selectors
import socket
import statistics
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from perdure import events as ev
from perdure.config.run import RunConfig, to_dict
from perdure.events import JsonLines
from perdure.runtime.channel import LineSocket, Message, verify
from perdure.runtime.detector import PhiAccrual
from perdure.runtime.plan import Plan, apportion, chain_order, from_counts, make_plan, rebalance

_TICK_S = 0.01


@dataclass
class WorkerInfo:
    """The coordinator's soft view of one admitted worker."""

    name: str
    region: str
    role: str
    line: LineSocket
    detector: PhiAccrual
    pid: int = 0
    next_step: int = 0
    has_state: bool = False
    slot_s: float | None = None
    alive: bool = True
    done: bool = False
    prepared: bool = False
    """Its trainer is built: it can enter an epoch without making the members wait."""


@dataclass
class Pending:
    """An announced membership epoch waiting for its members' ready reports."""

    epoch: int
    members: list[str]
    after: int
    reason: str
    plan_counts: list[int] | None
    announced: float
    ready: dict[str, dict[str, Any]] = field(default_factory=dict)


class Coordinator:
    """Runs the control plane of one run until every member has finished."""

    def __init__(
        self,
        config: RunConfig,
        *,
        run_dir: str,
        token: str,
        resume: str | None = None,
        host: str = "127.0.0.1",
        store_port: int = 0,
        channel_port: int = 0,
        expected_workers: int | None = None,
        standby: bool = False,
    ) -> None:
        self.config = config
        self.cluster = config.cluster
        self.run_dir = run_dir
        self.token = token
        self.resume = resume
        self.expected = expected_workers if expected_workers is not None else self.cluster.workers
        self.events = JsonLines(f"{run_dir}/events.jsonl")
        self.store = dist.TCPStore(
            host, store_port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.server = socket.create_server((host, channel_port))
        self.server.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ, None)
        self.host = host
        self.workers: dict[str, WorkerInfo] = {}
        self.unadmitted: dict[socket.socket, tuple[LineSocket, str]] = {}
        self.epoch = -1
        self.current: Plan | None = None
        self.pending: Pending | None = None
        self.started = time.time()
        self.last_replan = 0.0
        self.finished = False
        self.standby = standby
        self.last_admission = 0.0

    @property
    def store_port(self) -> int:
        return int(self.store.port)

    @property
    def channel_port(self) -> int:
        return int(self.server.getsockname()[1])

    # -- main loop -------------------------------------------------------------------------

    def serve(self, deadline_s: float | None = None) -> None:
        """Run until the run finishes (or ``deadline_s`` passes)."""
        self.events.write({"event": ev.COORDINATOR_UP, "channel_port": self.channel_port})
        end = None if deadline_s is None else time.monotonic() + deadline_s
        while not self.finished and (end is None or time.monotonic() < end):
            for key, _ in self.sel.select(timeout=_TICK_S):
                self._on_readable(key)
            self._tick(time.monotonic())
        self._shutdown()

    def _on_readable(self, key: selectors.SelectorKey) -> None:
        if key.data is None:
            self._accept()
            return
        sock = key.fileobj
        assert isinstance(sock, socket.socket)
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if sock in self.unadmitted:
            self._on_admission_bytes(sock, data)
            return
        info: WorkerInfo = key.data
        if not data:
            self._declare_dead(info, "connection closed (process exited)")
            return
        for msg in info.line.feed(data):
            self._on_message(info, msg)

    def _accept(self) -> None:
        try:
            sock, _ = self.server.accept()
        except OSError:
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        line = LineSocket(sock)
        nonce = secrets.token_hex(16)
        line.send({"type": "challenge", "nonce": nonce})
        self.unadmitted[sock] = (line, nonce)
        self.sel.register(sock, selectors.EVENT_READ, "admission")

    # -- admission -------------------------------------------------------------------------

    def _on_admission_bytes(self, sock: socket.socket, data: bytes) -> None:
        line, nonce = self.unadmitted[sock]
        msgs = line.feed(data) if data else []
        if not data or not msgs:
            if not data:
                self._drop_socket(sock)
            return
        hello = msgs[0]
        reason = self._refusal(hello, nonce)
        if reason:
            # Logged before the answer: whoever is refused can read why at once.
            self.events.write({"event": ev.REFUSED, "worker": hello.get("name"), "reason": reason})
            with contextlib.suppress(OSError):
                line.send({"type": "refused", "reason": reason})
            self._drop_socket(sock)
            return
        del self.unadmitted[sock]
        self._admit(sock, line, hello)

    def _refusal(self, hello: Message, nonce: str) -> str | None:
        if not verify(self.token, nonce, str(hello.get("mac", ""))):
            return "bad run token"
        name = str(hello.get("name", ""))
        old = self.workers.get(name)
        if not name or (old is not None and old.alive):
            return f"worker name {name!r} is already in use"
        if self.finished:
            return "the run is over"
        return None

    def _admit(self, sock: socket.socket, line: LineSocket, hello: Message) -> None:
        hb = self.cluster.heartbeat_ms / 1000
        info = WorkerInfo(
            name=str(hello["name"]),
            region=str(hello.get("region", "")),
            role=str(hello.get("role", "worker")),
            line=line,
            detector=PhiAccrual(
                expected_interval_s=hb, acceptable_pause_s=self.cluster.acceptable_pause_ms / 1000
            ),
            pid=int(hello.get("pid", 0)),
            next_step=int(hello.get("next_step", 0)),
            has_state=bool(hello.get("has_state", False)),
        )
        info.detector.heartbeat(time.monotonic())
        self.workers[info.name] = info
        self.last_admission = time.monotonic()
        if self.standby and self.epoch < 0 and not self.workers_seen_takeover:
            self.workers_seen_takeover = True
            self.events.write({"event": ev.COORDINATOR_TAKEOVER, "by": "standby"})
        # Epoch numbers only grow, across coordinators too: a worker ignores older ones.
        self.epoch = max(self.epoch, int(hello.get("epoch", -1)))
        self.sel.modify(sock, selectors.EVENT_READ, info)
        line.send(
            {
                "type": "welcome",
                "config": to_dict(self.config),
                "run_dir": self.run_dir,
                "resume": self.resume,
                "store_port": self.store_port,
                "epoch": self.epoch,
            }
        )
        self.events.write(
            {
                "event": ev.JOIN,
                "worker": info.name,
                "region": info.region,
                "role": info.role,
                "pid": info.pid,
            }
        )

    def _drop_socket(self, sock: socket.socket) -> None:
        self.unadmitted.pop(sock, None)
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(sock)
        sock.close()

    # -- messages --------------------------------------------------------------------------

    def _on_message(self, info: WorkerInfo, msg: Message) -> None:
        kind = msg.get("type")
        info.detector.heartbeat(time.monotonic())
        if kind == "hb":
            info.next_step = int(msg.get("next_step", info.next_step))
            info.prepared = info.prepared or bool(msg.get("prepared"))
            if msg.get("slot_s") is not None:
                info.slot_s = float(msg["slot_s"])
        elif kind == "ready":
            self._on_ready(info, msg)
        elif kind == "fail":
            self._on_fail(info, msg)
        elif kind == "event":
            self.events.write({k: v for k, v in msg.items() if k != "type"})
        elif kind == "leave":
            self._on_leave(info)
        elif kind == "evict":
            target = self.workers.get(str(msg.get("worker")))
            if target is not None:
                self._declare_dead(target, f"evicted: {msg.get('reason')}")
        elif kind == "done":
            info.done = True
            info.next_step = int(msg["next_step"])
            self.events.write({"event": ev.WORKER_DONE, "worker": info.name, **msg.get("info", {})})

    def _on_ready(self, info: WorkerInfo, msg: Message) -> None:
        info.next_step = int(msg["next_step"])
        info.has_state = bool(msg["has_state"])
        p = self.pending
        if p is not None and msg.get("epoch") == p.epoch and info.name in p.members:
            p.ready[info.name] = msg

    def _on_leave(self, info: WorkerInfo) -> None:
        """A graceful stop: finish the step in flight, then go on without the worker."""
        self.events.write({"event": ev.LEAVE_REQUESTED, "worker": info.name})
        info.role = "leaving"
        members = self._members_now()
        if info.name in members:
            rest = [m for m in members if m != info.name] + self._promote_spare(info)
            after = max(self.workers[m].next_step for m in members) + 1
            self._announce(rest, after=after, reason=f"{info.name} left gracefully")

    def _on_fail(self, info: WorkerInfo, msg: Message) -> None:
        self.events.write(
            {
                "event": ev.COLLECTIVE_FAILED,
                "worker": info.name,
                "epoch": msg.get("epoch"),
                "error": msg.get("error"),
            }
        )
        if msg.get("epoch") == self.epoch and self.pending is None:
            self._fail_epoch = time.monotonic()

    # -- decisions -------------------------------------------------------------------------

    _fail_epoch: float | None = None

    def _tick(self, now: float) -> None:
        self._detect(now)
        if self.finished:
            return
        if self.pending is not None:
            self._progress_pending(now)
            return
        if self._fail_epoch is not None and now - self._fail_epoch > 0.05:
            # A collective failed but nobody died: a link dropped. Re-form the same members.
            self._fail_epoch = None
            self._announce(self._members_now(), after=-1, reason="collective failed")
            return
        if self.current is None:
            self._maybe_first_epoch(now)
            return
        self._maybe_grow(now)
        self._maybe_replan(now)
        self._maybe_finish()

    def _detect(self, now: float) -> None:
        for info in list(self.workers.values()):
            if info.alive and info.detector.phi(now) > self.cluster.phi_threshold:
                self._declare_dead(info, f"phi > {self.cluster.phi_threshold} (no heartbeat)")

    def _declare_dead(self, info: WorkerInfo, reason: str) -> None:
        if not info.alive:
            return
        info.alive = False
        with contextlib.suppress(KeyError, ValueError):
            self.sel.unregister(info.line.sock)
        info.line.close()
        self.events.write({"event": ev.LEAVE, "worker": info.name, "reason": reason})
        in_current = self.current is not None and info.name in self.current.members
        in_pending = self.pending is not None and info.name in self.pending.members
        if (in_current or in_pending) and not self.finished:
            survivors = [m for m in self._members_now() if m != info.name]
            survivors += self._promote_spare(info)
            self._announce(survivors, after=-1, reason=f"{info.name} left: {reason}")

    def _promote_spare(self, lost: WorkerInfo) -> list[str]:
        """A warm spare (imported, admitted, idle) takes the lost member's place at once,
        preferring one in the same region."""
        ready = [w for w in self._alive("spare") if w.prepared]
        spares = sorted(ready, key=lambda w: (w.region != lost.region, w.name))
        if not spares:
            return []
        spare = spares[0]
        spare.role = "worker"
        self.events.write({"event": ev.SPARE_PROMOTED, "worker": spare.name, "for": lost.name})
        return [spare.name]

    def _alive(self, role: str | None = None) -> list[WorkerInfo]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]

    def _members_now(self) -> list[str]:
        base = (
            self.pending.members if self.pending else (self.current.members if self.current else ())
        )
        return [m for m in base if self.workers[m].alive]

    workers_seen_takeover = False

    def _maybe_first_epoch(self, now: float) -> None:
        workers = self._alive("worker")
        if self.standby:
            settled = now - self.last_admission > self.cluster.takeover_settle_ms / 1000
            if workers and settled:
                self._announce([w.name for w in workers], after=-1, reason="takeover")
            return
        waited = now - self.started > self.cluster.join_timeout_ms / 1000
        if len(workers) >= self.expected or (workers and waited):
            self._announce([w.name for w in workers], after=-1, reason="start")

    def _maybe_grow(self, now: float) -> None:
        """Admit idle workers (new or returning) at a step boundary, up to the configured
        worker count (and S). Past it, a ready worker becomes a warm spare: the next
        failure is then absorbed by promoting it, with no wait for a process to start."""
        members = set(self.current.members if self.current else ())
        idle = [
            w for w in self._alive("worker") if w.name not in members and not w.done and w.prepared
        ]
        room = min(self.config.train.slots, self.expected) - len(members)
        for w in idle[max(0, room) :]:
            w.role = "spare"
            self.events.write({"event": ev.BECAME_SPARE, "worker": w.name})
        if not idle or room <= 0:
            return
        after = self._boundary()
        if after < self.config.train.steps:
            names = sorted(members | {w.name for w in idle[:room]})
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
        if any(t is None for t in times):
            return
        known = [t for t in times if t is not None]
        speeds = [_speed(i, known, c.slow_ratio) for i in range(len(known))]
        new = rebalance(plan, speeds, max_moves=c.max_slot_moves)
        if new.counts() != plan.counts():
            self.last_replan = now
            self._announce(
                list(plan.members), after=self._boundary(), reason="rebalance", counts=new.counts()
            )

    def _boundary(self) -> int:
        """The first step of a planned (not failure-driven) epoch change: far enough ahead
        that no member has started it when the notice arrives. Heartbeats report a member's
        step up to a heartbeat interval late, and a member that has begun step ``after``
        must abandon it; with steps shorter than a heartbeat, ``last + 1`` meant one
        abandoned step per join."""
        plan = self.current
        members = plan.members if plan else []
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
            self.events.write({"event": ev.RUN_END, "next_step": members[0].next_step})
            for w in self._alive():
                self._send(w, {"type": "stop", "reason": "run complete"})
            self.finished = True

    # -- epochs ----------------------------------------------------------------------------

    def _announce(
        self, names: list[str], *, after: int, reason: str, counts: list[int] | None = None
    ) -> None:
        regions = [r.name for r in self.cluster.regions]
        members = chain_order([(n, self.workers[n].region) for n in names], regions)
        members = members[: self.config.train.slots]
        self.epoch += 1
        self.pending = Pending(self.epoch, members, after, reason, counts, time.monotonic())
        self.events.write(
            {
                "event": ev.EPOCH_ANNOUNCED,
                "epoch": self.epoch,
                "members": members,
                "after": after,
                "reason": reason,
            }
        )
        for w in self._alive():
            self._send(
                w, {"type": "epoch", "epoch": self.epoch, "members": members, "after": after}
            )

    def _progress_pending(self, now: float) -> None:
        p = self.pending
        assert p is not None
        if not p.members:
            # Every member is gone: start over with whoever is (or comes back) alive.
            idle = [w.name for w in self._alive("worker") if not w.done]
            if idle:
                self._announce(idle, after=-1, reason="all members lost")
            return
        if all(m in p.ready for m in p.members):
            self._start(p)
            return
        limit = max(5.0, 4 * self.cluster.min_collective_timeout_ms / 1000)
        if now - p.announced > limit:
            late = [m for m in p.members if m not in p.ready]
            self.events.write({"event": ev.READY_TIMEOUT, "epoch": p.epoch, "late": late})
            self._announce([m for m in p.members if m in p.ready], after=-1, reason="ready timeout")

    def _start(self, p: Pending) -> None:
        ready = p.ready
        with_state = [m for m in p.members if ready[m]["has_state"]]
        reload: str | None = None
        if with_state:
            start = max(int(ready[m]["next_step"]) for m in with_state)
            source = next(
                m for m in p.members if m in with_state and ready[m]["next_step"] == start
            )
            receivers = [
                m for m in p.members if not ready[m]["has_state"] or ready[m]["next_step"] != start
            ]
        else:
            reload, start = self._newest_checkpoint()
            source, receivers = p.members[0], []
            self.events.write(
                {
                    "event": ev.RECOVERED_FROM_CHECKPOINT,
                    "epoch": p.epoch,
                    "checkpoint": reload,
                    "start_step": start,
                }
            )
        plan = self._plan(p)
        msg = {
            "type": "start",
            "epoch": p.epoch,
            "plan": plan.to_dict(),
            "start_step": start,
            "source": source,
            "receivers": receivers,
            "recover": not with_state,
            "reload": reload,
            "prefix": f"pg/{p.epoch}/{secrets.token_hex(4)}/",
        }
        for m in p.members:
            self._send(self.workers[m], msg)
            self.workers[m].next_step = start
        self.current, self.pending = plan, None
        self.last_replan = time.monotonic()
        self._fail_epoch = None
        self.events.write(
            {
                "event": ev.EPOCH_STARTED,
                "epoch": p.epoch,
                "start_step": start,
                "source": source,
                "receivers": receivers,
                "plan": plan.to_dict(),
                "reason": p.reason,
            }
        )

    def _newest_checkpoint(self) -> tuple[str | None, int]:
        """Where a run whose every replica is lost starts again: the newest intact
        checkpoint (or the resume point, or step 0, rebuilt from the seed)."""
        from perdure.checkpoint import latest_checkpoint, read_manifest

        found = latest_checkpoint(f"{self.run_dir}/checkpoints") or self.resume
        if found is None:
            return None, 0
        return str(found), int(read_manifest(found)["step"])

    def _plan(self, p: Pending) -> Plan:
        S = self.config.train.slots
        if p.plan_counts is not None and len(p.plan_counts) == len(p.members):
            return from_counts(p.members, p.plan_counts)
        if self.current is not None and list(self.current.members) == p.members:
            return Plan(tuple(p.members), self.current.ranges)
        return make_plan(p.members, S)

    def _send(self, info: WorkerInfo, msg: Message) -> None:
        try:
            info.line.send(msg)
        except OSError:
            self._declare_dead(info, "send failed")

    def _shutdown(self) -> None:
        for w in self.workers.values():
            w.line.close()
        self.server.close()
        self.sel.close()


def boundary_margin(step_s: float | None, heartbeat_s: float, cap: int = 20) -> int:
    """Extra steps before a planned epoch change: how many steps a heartbeat's staleness
    plus the notice's delivery (one more heartbeat interval, generously) can cover."""
    if not step_s or step_s <= 0:
        return 1
    return min(cap, math.ceil(2 * heartbeat_s / step_s))


def _speed(i: int, times: list[float], slow_ratio: float) -> float:
    """1.0 unless member ``i`` takes over ``slow_ratio`` times the median of the others per
    slot; then the ratio of that median to its time (its fair share of the slots)."""
    others = times[:i] + times[i + 1 :]
    base = statistics.median(others)
    return 1.0 if times[i] <= slow_ratio * base else base / times[i]


__all__ = ["Coordinator", "apportion"]
