"""The worker's side of the control plane: admission, notices, heartbeats, reconnection.

A :class:`MembershipClient` holds the channel to the coordinator (or, once that is lost,
to the first standby that answers), records what the coordinator announced (the newest
epoch notice, the start of each epoch, the end of the run) and answers the step loop's
one question: must step ``t`` stop in this epoch? It knows nothing of training.

Workers prefer the primary: coordinators are tried in the order given, the primary first,
on every reconnection. A coordinator that cannot admit now (a standby that does not hold
the run's lease, a coordinator renewing its own) answers "retry", and the worker goes on
to the next one and round again, with a growing pause, until its join timeout: reaching a
standby is not a reason to follow it. The client remembers the newest coordinator
generation it followed: it announces it in every hello (an older coordinator that reads
it fences itself out), refuses a welcome from an older one, and leaves its coordinator
when the run directory's fence shows a newer one (:meth:`fenced_by`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

from perdure.runtime.control import protocol as p
from perdure.runtime.control.channel import (
    UNACKED_S,
    AdmissionRefused,
    LineSocket,
    Listener,
    connect,
    unacked_limit,
)

log = logging.getLogger("perdure.worker")

CONNECT_TIMEOUT_S = 5.0
RETRY_PAUSE_S = (0.1, 0.5)
"""Pause between rounds over the coordinators: first, and most (it grows by half)."""


class RunEnded(ConnectionError):
    """The run ended while this worker had no coordinator: nothing to reconnect to."""


def route_source(host: str) -> str:
    """The address this machine sends from to reach ``host`` (the kernel's route; no
    packet is sent), or "" when there is no route."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return str(s.getsockname()[0])
    except OSError:
        return ""


@dataclass(frozen=True)
class Identity:
    """Who a worker is, as its hello says."""

    name: str
    region: str
    role: str


class MembershipClient:
    """The channel to the coordinator and what it said, shared by the worker's threads."""

    def __init__(
        self,
        me: Identity,
        coordinators: list[tuple[str, int]],
        token: str,
        *,
        timeout_s: float,
        progress: Callable[[], tuple[int, bool]],
        address: str | None = None,
    ) -> None:
        self.me, self.coordinators, self.token = me, coordinators, token
        self.timeout_s = timeout_s
        self.progress = progress
        """``() -> (next_step, has_state)`` for the hello."""
        self.address = address
        """The data plane's address (``--host`` / ``--interface``); unset: this worker's
        own address on the path to the coordinator it reaches."""
        self.run_over: Callable[[], bool] = lambda: False
        """Whether the run ended meanwhile (set once the run directory is known): a
        worker that lost its coordinator stops trying to reconnect then."""
        self._trying = ""
        self.cond = threading.Condition()
        self.on_notice: Callable[[], None] = lambda: None
        """Called (holding ``cond``: it must not block) on each message of the coordinator
        (an announcement, a start, a drain, a stop) and on its loss: the worker wakes its
        collectives' waits with it to look at them (``comm.group.wake_waits``)."""
        self.announce: p.Announce | None = None
        self.starts: dict[int, p.Start] = {}
        self.stopped = False
        self.stop_reason = ""
        self.drain: p.Drain | None = None
        self.lost = False
        self.epoch_no = -1
        self.line: LineSocket | None = None
        self.unacked_s = UNACKED_S
        """The channel's ``TCP_USER_TIMEOUT`` (``channel.UNACKED_S``)."""
        self.host = ""
        self.generation = 0
        """The newest coordinator generation this worker followed."""

    # -- connection ------------------------------------------------------------------------

    def _hello(self, mac: str) -> p.Hello:
        next_step, has_state = self.progress()
        return p.Hello(
            name=self.me.name,
            region=self.me.region,
            role=self.me.role,
            pid=os.getpid(),
            next_step=next_step,
            has_state=has_state,
            epoch=self.epoch_no,
            mac=mac,
            address=self.address or route_source(self._trying),
            generation=self.generation,
        )

    def set_unacked_limit(self, seconds: float) -> None:
        """The channel's ``TCP_USER_TIMEOUT`` from now on (the run's config asks for more
        than the default when it tolerates longer pauses)."""
        self.unacked_s = seconds
        if self.line is not None:
            unacked_limit(self.line.sock, seconds)

    def connect(self) -> p.Welcome:
        """Reach the first coordinator that admits this worker, trying each in turn until
        ``timeout_s`` passes."""
        end = time.monotonic() + self.timeout_s
        last: Exception | None = None
        pause = RETRY_PAUSE_S[0]
        while time.monotonic() < end:
            if self.run_over():
                raise RunEnded(f"{self.me.name}: the run ended while it was reconnecting")
            for host, port in self.coordinators:
                self._trying = host
                try:
                    line, welcome = connect(host, port, self.token, self._hello, CONNECT_TIMEOUT_S)
                except AdmissionRefused as e:
                    if p.RUN_OVER in str(e):  # reconnected after the end: nothing to rejoin
                        raise RunEnded(f"{self.me.name}: {e}") from None
                    if not e.retry:
                        raise
                    last = e
                    continue
                except (OSError, ConnectionError, p.ProtocolError) as e:
                    last = e
                    continue
                if welcome.generation < self.generation:
                    line.close()  # a superseded coordinator (it fences itself on our hello)
                    last = ConnectionError(f"{host}:{port} is at old generation")
                    continue
                unacked_limit(line.sock, self.unacked_s)
                self.line, self.host = line, host
                with self.cond:
                    self.lost, self.announce = False, None
                    self.generation = welcome.generation
                # Bound to this line: a listener of a line we left must not touch the next.
                on_message = partial(self._on_message, line=line)
                Listener(line, on_message, partial(self._on_lost, line)).start()
                return welcome
            time.sleep(pause)
            pause = min(RETRY_PAUSE_S[1], pause * 1.5)
        raise ConnectionError(
            f"{self.me.name}: no coordinator reachable at {self.coordinators}: {last}"
        )

    def _on_message(self, msg: p.Message, line: LineSocket) -> None:
        with self.cond:
            if line is not self.line:
                return  # a late message on a channel this worker already left
            if isinstance(msg, p.Announce | p.Start) and msg.generation != self.generation:
                # Not the generation this connection was admitted under: a broken peer.
                log.warning(
                    "%s: %s of generation %d on a channel of generation %d",
                    self.me.name,
                    msg.type,
                    msg.generation,
                    self.generation,
                )
                self._drop()
                return
            if isinstance(msg, p.Announce):
                self.announce = msg
            elif isinstance(msg, p.Start):
                self.starts[msg.epoch] = msg
            elif isinstance(msg, p.Drain):
                self.drain = msg
            elif isinstance(msg, p.Stop):
                self.stopped, self.stop_reason = True, msg.reason
            self.cond.notify_all()
            self.on_notice()

    def _on_lost(self, line: LineSocket | None = None) -> None:
        with self.cond:
            if line is not None and line is not self.line:
                return  # the end of a channel this worker already left
            self.lost = True
            self.cond.notify_all()
            self.on_notice()

    def _drop(self) -> None:
        """Leave the coordinator (caller holds ``cond``): the step loop stops at once and
        the next announcement wait reconnects."""
        self.lost = True
        if self.line is not None:
            with contextlib.suppress(OSError):  # wakes the listener's blocked recv
                self.line.sock.shutdown(socket.SHUT_RDWR)
            self.line.close()
        self.cond.notify_all()
        self.on_notice()

    def fenced_by(self, generation: int) -> bool:
        """The run directory's fence is at ``generation``: if that is newer than the
        coordinator we follow, leave it (True) and find the newer one."""
        with self.cond:
            if generation <= self.generation or self.lost:
                return False
            self.generation = generation  # from now on, no older coordinator is followed
            self._drop()
            return True

    def local_address(self) -> str | None:
        """This worker's address on the path to its coordinator: where its peers reach it
        (the data plane binds there, never on every interface)."""
        try:
            return str(self.line.sock.getsockname()[0]) if self.line is not None else None
        except OSError:
            return None

    def send(self, msg: p.FromWorker) -> None:
        try:
            if self.line is not None:
                self.line.send(msg)
        except OSError:
            self._on_lost()

    # -- what the coordinator said ---------------------------------------------------------

    def next_announcement(self, on_reconnect: Callable[[p.Welcome], None]) -> p.Announce | None:
        """Block until an announcement newer than the current epoch (None: stop). A lost
        channel is reconnected here (``on_reconnect`` gets the new welcome)."""
        with self.cond:
            while True:
                if self.stopped:
                    return None
                if self.lost:
                    self.cond.release()
                    try:
                        on_reconnect(self.connect())
                    except RunEnded as e:
                        self.stopped, self.stop_reason = True, str(e)
                    finally:
                        self.cond.acquire()
                    continue
                a = self.announce
                if a is not None and a.epoch > self.epoch_no:
                    return a
                self.cond.wait(timeout=1.0)

    def wait_start(self, epoch: int) -> p.Start | None:
        """The start of ``epoch`` (None: superseded, stopped or lost first)."""
        with self.cond:
            while epoch not in self.starts:
                a = self.announce
                if self.stopped or self.lost or (a is not None and a.epoch > epoch):
                    self.epoch_no = epoch
                    return None
                self.cond.wait(timeout=1.0)
            self.epoch_no = epoch
            return self.starts.pop(epoch)

    def last_step(self, steps: int) -> int:
        """The step the run ends at: ``steps``, or earlier once a drain was asked for."""
        return steps if self.drain is None else min(steps, self.drain.step)

    def save_must_stop(self) -> bool:
        """True when this epoch's checkpoint commit must give up waiting for its ranks: the
        run stopped, this worker is lost, or a newer epoch re-forms at once (``after`` < 0:
        a member was lost, and one of the save's ranks may never reach it). A planned change
        (a join, a rebalance, a leave at a boundary) is not one: every member of this epoch
        reaches the boundary and closes its writer, which waits for the save in flight, so
        the save commits instead of being abandoned."""
        return self.should_stop(None)

    def should_stop(self, step: int | None) -> bool:
        """True when step ``step`` must not run (or be abandoned) in the current epoch
        (None: no step, only a re-forming at once counts: :meth:`save_must_stop`)."""
        if self.stopped or self.lost:
            return True
        a = self.announce
        if a is None or a.epoch <= self.epoch_no:
            return False
        return a.after < 0 or (step is not None and a.after <= step)
