"""The worker's side of the control plane: admission, notices, heartbeats, reconnection.

A :class:`MembershipClient` holds the channel to the coordinator (or, once that is lost,
to the first standby that answers), records what the coordinator announced (the newest
epoch notice, the start of each epoch, the end of the run) and answers the step loop's
one question: must step ``t`` stop in this epoch? It knows nothing of training.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from perdure.runtime.control import protocol as p
from perdure.runtime.control.channel import AdmissionRefused, LineSocket, Listener, connect

log = logging.getLogger("perdure.worker")

CONNECT_TIMEOUT_S = 5.0


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
        self.announce: p.Announce | None = None
        self.starts: dict[int, p.Start] = {}
        self.stopped = False
        self.stop_reason = ""
        self.drain: p.Drain | None = None
        self.lost = False
        self.epoch_no = -1
        self.line: LineSocket | None = None
        self.host = ""

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
        )

    def connect(self) -> p.Welcome:
        """Reach the first coordinator that admits this worker, trying each in turn until
        ``timeout_s`` passes."""
        end = time.monotonic() + self.timeout_s
        last: Exception | None = None
        while time.monotonic() < end:
            if self.run_over():
                raise RunEnded(f"{self.me.name}: the run ended while it was reconnecting")
            for host, port in self.coordinators:
                self._trying = host
                try:
                    line, welcome = connect(host, port, self.token, self._hello, CONNECT_TIMEOUT_S)
                except (OSError, ConnectionError, p.ProtocolError) as e:
                    last = e
                    continue
                except AdmissionRefused as e:
                    if p.RUN_OVER in str(e):  # reconnected after the end: nothing to rejoin
                        raise RunEnded(f"{self.me.name}: {e}") from None
                    raise
                self.line, self.host = line, host
                with self.cond:
                    self.lost, self.announce = False, None
                Listener(line, self._on_message, self._on_lost).start()
                return welcome
            time.sleep(0.1)
        raise ConnectionError(
            f"{self.me.name}: no coordinator reachable at {self.coordinators}: {last}"
        )

    def _on_message(self, msg: p.Message) -> None:
        with self.cond:
            if isinstance(msg, p.Announce):
                self.announce = msg
            elif isinstance(msg, p.Start):
                self.starts[msg.epoch] = msg
            elif isinstance(msg, p.Drain):
                self.drain = msg
            elif isinstance(msg, p.Stop):
                self.stopped, self.stop_reason = True, msg.reason
            self.cond.notify_all()

    def _on_lost(self) -> None:
        with self.cond:
            self.lost = True
            self.cond.notify_all()

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

    def should_stop(self, step: int) -> bool:
        """True when step ``step`` must not run (or be abandoned) in the current epoch."""
        if self.stopped or self.lost:
            return True
        a = self.announce
        if a is None or a.epoch <= self.epoch_no:
            return False
        return a.after < 0 or a.after <= step
