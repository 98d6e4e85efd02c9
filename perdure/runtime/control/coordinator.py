"""The coordinator's server: sockets, the run's store and the clock around the pure policy.

It accepts connections, sends each a challenge, checks the answer's HMAC, decodes every
line through the typed protocol, and turns what happens into the policy's events (a
hello, a message, a closed socket, a tick). It then carries out the policy's effects in
order. A send that fails is queued as a :class:`~policy.Closed` event for the next turn;
nothing the server does re-enters the policy.

Nothing a peer sends can stop it: a line that is not a valid message disconnects that
peer (and is logged), a line without a newline is bounded (``protocol.MAX_LINE``), and
connections that have not said hello yet wait at the door (``control/door.py``: a
deadline, a bound, counted refusals). What is refused before authentication, at the door
and at the store, is logged once per interval (``control/refusals.py``), so no flood
grows the event log by more.

The run's lease (``control/lease.py``) is set up here: a primary acquires it before it
serves (a new generation, installed in the run directory's fence), a standby starts
watching it; from then on its I/O runs on the lease agent's thread
(``control/lease_agent.py``), whose answers join the queue as events.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import select
import selectors
import socket
import time
from collections import deque
from dataclasses import replace

from perdure import events as ev
from perdure.events import Tail
from perdure.metrics.service import MetricsService
from perdure.run_config import RunConfig
from perdure.runlog import Mergers, part, writer_id
from perdure.runtime.control import policy as pol
from perdure.runtime.control import protocol as p
from perdure.runtime.control.address import Endpoints, coordinator_endpoints, host_port
from perdure.runtime.control.channel import LineSocket
from perdure.runtime.control.door import Conn, Door, close_line
from perdure.runtime.control.launched import launched_pid
from perdure.runtime.control.lease import acquire_for_primary, holder_record
from perdure.runtime.control.lease_agent import LeaseAgent
from perdure.runtime.control.lease_backends import open_lease_store
from perdure.runtime.control.liveness import Watcher
from perdure.runtime.control.store import StoreServer

log = logging.getLogger("perdure.coordinator")

TICK_S = 0.01
RUN_END_POLL_S = 0.5
"""How often an idle standby looks for the run's end in the merged event log."""

DIED = "process exited (its liveness lock released)"
"""A ``leave``'s reason when a worker's liveness lock tells of its death
(``control/liveness.py``), before its socket closes."""

_ALIVE = object()
"""The selector's mark on the liveness watcher's wake socket."""


class Coordinator:
    """Serves the control plane of one run until every member has finished."""

    def __init__(
        self,
        config: RunConfig,
        *,
        run_dir: str,
        token: str,
        resume: str | None = None,
        endpoints: Endpoints | None = None,
        expected_workers: int | None = None,
        standby: bool = False,
        allow_config_change: bool = False,
        primary: str | None = None,
    ) -> None:
        """``endpoints``: where to listen (``address.coordinator_endpoints``; default:
        the cluster config's). Every listener binds ``endpoints.bind`` only. ``primary`` (a
        standby's): the ``HOST:PORT`` it probes the primary at before taking over; default:
        the channel the primary recorded with its lease."""
        self.config, self.run_dir, self.token = config, run_dir, token
        self.endpoints = endpoints or coordinator_endpoints(config.cluster)
        self.host = self.endpoints.advertise
        """What peers dial (published in the ports file and the events)."""
        bind = self.endpoints.bind
        self.events = part(run_dir, "events", writer_id("standby" if standby else "coordinator"))
        self.logs = Mergers(run_dir, new_launch=not standby)
        """Merges every process's part files into events.jsonl and metrics.jsonl while
        this coordinator is the active one (``runlog.py``)."""
        self.run_over = False
        """A standby saw the run end under the primary (it then exits too)."""
        self._ended = Tail(f"{run_dir}/events.jsonl", from_end=True)
        self._ended_check = 0.0
        self.store = StoreServer(bind, self.endpoints.store_port, token)
        self.server = _listen(bind, self.endpoints.channel_port, "--channel-port")
        self.server.setblocking(False)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.server, selectors.EVENT_READ, None)
        self.alive = Watcher(run_dir)
        """Waits on the liveness locks of this host's workers (``control/liveness.py``)."""
        self.sel.register(self.alive.wake, selectors.EVENT_READ, _ALIVE)
        self.door = Door(
            self.server, self.sel, token,
            challenge=lambda: (self.policy.generation, self.policy.serving),
            post=self._on_hello, launched=self._launched,
        )  # fmt: skip
        expected = expected_workers if expected_workers is not None else config.cluster.workers
        settings = pol.Settings(
            config=config,
            run_dir=run_dir,
            resume=resume,
            store_port=self.store_port,
            instance=secrets.token_hex(4),
            expected=expected,
            standby=standby,
            allow_config_change=allow_config_change,
        )
        self.lines: dict[str, LineSocket] = {}
        self.queue: deque[pol.Event] = deque()
        self.policy = self._lease(settings, primary)
        self.metrics = MetricsService(
            config.metrics, run_dir=run_dir, host=bind, steps=config.train.steps,
            standby=standby, active=lambda: not standby or self.policy.took_over,
        )  # fmt: skip
        self.finished = False

    def _lease(self, settings: pol.Settings, primary: str | None) -> pol.Policy:
        """Acquire (a primary) or watch (a standby) the run's lease; the policy over it."""
        c = self.config.cluster
        store = open_lease_store(
            c.ha_backend,
            run_dir=self.run_dir,
            ttl_s=c.lease_ttl_ms / 1000,
            token=self.token,
            etcd_endpoints=list(c.etcd_endpoints),
            etcd_prefix=c.etcd_prefix,
        )
        role = "standby" if settings.standby else "primary"
        # Limit: a wildcard bind address is recorded as is; a standby then needs --primary.
        holder = holder_record(settings.instance, host_port(self.host, self.channel_port), role)
        generation, until = 0, -math.inf
        if not settings.standby:
            grant = acquire_for_primary(store, self.run_dir, holder)
            generation, until = grant.generation, grant.until
        self.agent = LeaseAgent(
            store, self.run_dir, holder, self.queue.append, generation=generation, primary=primary
        )
        settings = replace(settings, generation=max(1, generation))
        return pol.Policy(settings, time.monotonic(), lease_until=until)

    @property
    def store_port(self) -> int:
        return int(self.store.port)

    @property
    def channel_port(self) -> int:
        return int(self.server.getsockname()[1])

    @property
    def workers(self) -> dict[str, pol.Member]:
        return self.policy.workers

    @property
    def unadmitted(self) -> dict[int, Conn]:
        """The connections at the door (``door.py``), by id."""
        return self.door.unadmitted

    # -- main loop -------------------------------------------------------------------------

    def serve(self, deadline_s: float | None = None) -> None:
        """Run until the run finishes (or ``deadline_s`` passes, or :meth:`stop`)."""
        self.events.write(
            {
                "event": ev.COORDINATOR_UP,
                "host": self.host,
                "bind": self.endpoints.bind,
                "channel_port": self.channel_port,
                "store_port": self.store_port,
                "standby": self.policy.s.standby,
                "generation": self.policy.generation,
            }
        )
        end = None if deadline_s is None else time.monotonic() + deadline_s
        try:
            while not self.finished and (end is None or time.monotonic() < end):
                ready = self.sel.select(timeout=TICK_S)  # deaths first: see _on_deaths
                for key, _ in sorted(ready, key=lambda kv: kv[0].data is not _ALIVE):
                    self._on_readable(key)
                now = time.monotonic()
                self.door.expire(now)
                self._log_refusals(now)
                self.queue.append(pol.Tick(now))
                self._drain()
                if self.active:
                    self.logs.tick(now, generation=self.policy.generation)
                else:
                    self._watch_run_end(now)
        finally:
            self._shutdown()

    @property
    def active(self) -> bool:
        """Whether this coordinator runs the run now: the primary, or a standby that took
        over (only the active one merges the logs)."""
        return not self.policy.s.standby or self.policy.took_over

    def _watch_run_end(self, now: float) -> None:
        """An idle standby ends with the run: once the primary logs its end (or failure),
        there is nothing left to take over."""
        if now - self._ended_check < RUN_END_POLL_S:
            return
        self._ended_check = now
        if any(e.get("event") in (ev.RUN_END, ev.RUN_FAILED) for e in self._ended.read()):
            self.run_over = True
            self.finished = True

    def stop(self) -> None:
        self.finished = True

    def request_drain(self, reason: str) -> None:
        """Ask for an early, clean stop (safe from a signal handler: one deque append; the
        policy sees it on the loop's next turn)."""
        self.queue.append(pol.DrainRequested(reason, time.monotonic()))

    def _drain(self) -> None:
        """Feed queued events to the policy one at a time; effects may queue more."""
        while self.queue:
            for effect in self.policy.handle(self.queue.popleft()):
                self._carry_out(effect)

    # -- effects ---------------------------------------------------------------------------

    def _carry_out(self, effect: pol.Effect) -> None:
        if isinstance(effect, pol.Send):
            self._send(effect.to, effect.msg)
        elif isinstance(effect, pol.Log):
            self.events.write(dict(effect.record))
        elif isinstance(effect, pol.Accept):
            self._accept_worker(effect)
        elif isinstance(effect, pol.Reject):
            self._reject(effect)
        elif isinstance(effect, pol.CountRefusal):
            conn = self.door.unadmitted.get(effect.conn)
            if conn is not None:
                self.door.drop(conn, effect.reason)
        elif isinstance(effect, pol.Disconnect):
            self._disconnect(effect.worker)
        elif isinstance(effect, pol.FindCheckpoint):
            self.queue.append(self._find_checkpoint(effect.epoch))
        elif isinstance(effect, pol.Finish):
            self.finished = True
        else:
            self.agent.submit(effect)

    def _send(self, worker: str, msg: p.FromCoordinator) -> None:
        line = self.lines.get(worker)
        if line is None:
            return
        try:
            line.send(msg)
        except OSError as e:
            self.queue.append(pol.Closed(worker, f"send failed: {e}", time.monotonic()))

    def _accept_worker(self, effect: pol.Accept) -> None:
        conn = self.door.take(effect.conn)
        if conn is None:
            return
        self.lines[effect.worker] = conn.line
        self.sel.modify(conn.line.sock, selectors.EVENT_READ, effect.worker)
        self._send(effect.worker, effect.welcome)

    def _reject(self, effect: pol.Reject) -> None:
        conn = self.door.take(effect.conn)
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.line.send(p.Refused(reason=effect.reason, retry=effect.retry))
            close_line(self.sel, conn.line)

    def _disconnect(self, worker: str) -> None:
        line = self.lines.pop(worker, None)
        if line is not None:
            close_line(self.sel, line)

    def _find_checkpoint(self, epoch: int) -> pol.CheckpointFound:
        """Where a run whose every replica is lost starts again: the newest intact
        checkpoint (or the resume point, or step 0, rebuilt from the seed)."""
        from perdure.checkpoint import latest_checkpoint, read_manifest
        from perdure.checkpoint.config import checkpoint_root

        root = checkpoint_root(self.config.checkpoint, self.run_dir)
        found = latest_checkpoint(root) or self.policy.s.resume
        step = int(read_manifest(found)["step"]) if found is not None else 0
        path = str(found) if found is not None else None
        return pol.CheckpointFound(epoch, path, step, time.monotonic())

    # -- sockets ---------------------------------------------------------------------------

    def _on_readable(self, key: selectors.SelectorKey) -> None:
        if key.data is None:
            self.door.accept()
            return
        if key.data is _ALIVE:
            self._on_deaths()
            return
        sock = key.fileobj
        assert isinstance(sock, socket.socket)
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        if isinstance(key.data, int):
            self.door.on_bytes(key.data, data)
        else:
            self._on_worker_bytes(key.data, data)

    def _on_worker_bytes(self, worker: str, data: bytes) -> None:
        now = time.monotonic()
        line = self.lines.get(worker)
        if line is None:
            return
        if not data:
            self.queue.append(pol.Closed(worker, "connection closed (process exited)", now))
            return
        try:
            msgs = line.feed(data)
        except p.ProtocolError as e:
            log.warning("%s broke the protocol: %s", worker, e)
            self.queue.append(pol.Closed(worker, f"protocol error: {e}", now))
            return
        wall = time.time()
        member = self.policy.workers.get(worker)  # its liveness lock, once it has one
        if member is not None and member.alive:  # (made after its welcome)
            self.alive.watch(worker, member.pid)
        for msg in msgs:
            if isinstance(msg, p.FromWorker):
                self.queue.append(pol.Received(worker, msg, now, wall))
            else:
                self.queue.append(pol.Closed(worker, f"protocol error: sent {msg.type}", now))
                return

    def _on_deaths(self) -> None:
        """Workers whose liveness lock the kernel released: each is closed as its socket's
        end would close it, once what it sent before it died is read (a worker on this
        host: its lines are in the socket already). Handled before the sockets of the
        same wake-up, so the leave's reason is the lock's whenever it came first; the
        socket's own end, later, finds the worker gone (a second close does nothing)."""
        for name, pid in self.alive.take():
            member = self.policy.workers.get(name)
            if member is None or not member.alive or member.pid != pid:
                continue  # gone already, or the name is another process's now
            for chunk in _buffered(self.lines.get(name)):
                self._on_worker_bytes(name, chunk)
            self.queue.append(pol.Closed(name, DIED, time.monotonic()))

    def _on_hello(self, joined: pol.Joined) -> None:
        self.queue.append(joined)
        self._drain()

    def _launched(self, name: str) -> int | None:
        """The launcher's pid for ``name``, read only when a live member holds the name."""
        held = self.policy.workers.get(name)
        return launched_pid(self.run_dir, name) if held is not None and held.alive else None

    def _log_refusals(self, now: float, final: bool = False) -> None:
        """One record per door and interval for what was refused before authentication."""
        for door in (self.door.refusals, self.store.refusals):
            record = door.take(now, final=final)
            if record is not None:
                self.events.write(record)

    def _shutdown(self) -> None:
        self.agent.close()  # lands a queued EndLease before the process goes
        self.alive.close()
        for line in list(self.lines.values()):
            line.close()
        self.door.close()
        self.server.close()
        self.sel.close()
        self.store.close()
        self._log_refusals(time.monotonic(), final=True)
        if self.active:
            self.logs.tick(time.monotonic(), final=True, generation=self.policy.generation)
        self.metrics.close()  # a last pass: the final steps reach TensorBoard


def _buffered(line: LineSocket | None) -> list[bytes]:
    """What ``line``'s socket holds now, without waiting (its end, if there, is left to
    the selector). Readiness is polled first: the socket has a timeout, so a ``recv``
    would wait in Python's own poll until the peer's sockets close (~20 ms measured for a
    dying worker: the very wait its liveness lock saves)."""
    chunks: list[bytes] = []
    poll = select.poll()
    if line is not None:
        poll.register(line.sock, select.POLLIN)
    while line is not None and poll.poll(0):
        try:
            data = line.sock.recv(65536)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    return chunks


def _listen(host: str, port: int, flag: str) -> socket.socket:
    """A listening socket on ``host:port`` only; an address this machine does not hold,
    or a port in use, is an error naming the flag (not a traceback)."""
    try:
        return socket.create_server((host, port))
    except OSError as e:
        raise OSError(
            e.errno, f"cannot listen on {host}:{port} ({flag} / --host): {e.strerror}"
        ) from None


__all__ = ["Coordinator"]
