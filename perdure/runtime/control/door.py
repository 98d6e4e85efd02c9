"""The coordinator's door: connections that have not said hello yet.

Each accepted connection gets a challenge at once (carrying this coordinator's generation
and whether it serves, for a standby's probe); its first line must be a hello, which is
turned into a :class:`~events.Joined` event with whether its HMAC checked out. Nothing a
peer sends before that can stop the server: a line that is not a hello drops the
connection, a connection that has not answered within ``ADMISSION_S`` of its accept is
dropped, and at most ``MAX_UNADMITTED`` connections wait at once (a new one drops the
oldest: a flood cannot keep a worker out, whose hello takes one round trip). What is
refused here is counted (``refusals.py``), never logged line by line.
"""

from __future__ import annotations

import contextlib
import secrets
import selectors
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass

from perdure.runtime.control import protocol as p
from perdure.runtime.control.channel import LineSocket, verify
from perdure.runtime.control.events import Joined
from perdure.runtime.control.refusals import Refusals

ADMISSION_S = 10.0
"""Seconds a new connection has to answer its challenge."""
MAX_UNADMITTED = 256
SEND_TIMEOUT_S = 5.0
"""A send to a worker that does not read (its buffers full) fails after this long."""


@dataclass
class Conn:
    """A connection waiting for its hello."""

    id: int
    line: LineSocket
    nonce: str
    since: float


def close_line(sel: selectors.BaseSelector, line: LineSocket) -> None:
    """Stop watching ``line`` and close it (either may have happened already)."""
    with contextlib.suppress(KeyError, ValueError):
        sel.unregister(line.sock)
    line.close()


class Door:
    """Challenges new connections and turns their hellos into events."""

    def __init__(
        self,
        server: socket.socket,
        sel: selectors.BaseSelector,
        token: str,
        *,
        challenge: Callable[[], tuple[int, bool]],
        post: Callable[[Joined], None],
        launched: Callable[[str], int | None],
    ) -> None:
        """``challenge``: the generation and serving flag to announce; ``post``: takes
        each hello's event; ``launched``: the launcher's pid for a name, if it matters."""
        self.server, self.sel, self.token = server, sel, token
        self.challenge, self.post, self.launched = challenge, post, launched
        self.unadmitted: dict[int, Conn] = {}
        self.refusals = Refusals("channel")
        self._next = 0

    def accept(self) -> None:
        try:
            sock, _ = self.server.accept()
        except OSError:
            return
        if len(self.unadmitted) >= MAX_UNADMITTED:  # a flood: the oldest goes
            self.drop(next(iter(self.unadmitted.values())), "too many unadmitted connections")
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(SEND_TIMEOUT_S)
        line = LineSocket(sock)
        conn = Conn(self._next, line, secrets.token_hex(16), time.monotonic())
        self._next += 1
        generation, serving = self.challenge()
        try:
            line.send(p.Challenge(nonce=conn.nonce, generation=generation, serving=serving))
        except OSError:
            sock.close()
            return
        self.unadmitted[conn.id] = conn
        self.sel.register(sock, selectors.EVENT_READ, conn.id)

    def on_bytes(self, conn_id: int, data: bytes) -> None:
        conn = self.unadmitted.get(conn_id)
        if conn is None:
            return
        if not data:
            self.drop(conn, None)
            return
        try:
            msgs = conn.line.feed(data)
        except p.ProtocolError as e:
            self.drop(conn, f"protocol error: {e}")
            return
        if not msgs:
            return
        hello = msgs[0]
        if not isinstance(hello, p.Hello):
            self.drop(conn, f"protocol error: expected hello, got {hello.type}")
            return
        conn.line.queued = []
        authentic = verify(self.token, conn.nonce, hello.mac)
        pid = self.launched(hello.name) if authentic else None
        self.post(Joined(conn.id, hello, authentic, time.monotonic(), pid))

    def expire(self, now: float) -> None:
        for conn in [c for c in self.unadmitted.values() if now - c.since > ADMISSION_S]:
            self.drop(conn, f"no hello within {ADMISSION_S:g} s")

    def take(self, conn_id: int) -> Conn | None:
        """The connection ``conn_id`` leaves the door (admitted or refused)."""
        return self.unadmitted.pop(conn_id, None)

    def drop(self, conn: Conn, reason: str | None) -> None:
        """Close a connection that was never admitted; count why (logged once per
        interval with the others), unless it just closed."""
        self.unadmitted.pop(conn.id, None)
        if reason is not None:
            self.refusals.note(reason, time.monotonic())
            with contextlib.suppress(OSError):
                conn.line.send(p.Refused(reason=reason))
        close_line(self.sel, conn.line)

    def close(self) -> None:
        for conn in list(self.unadmitted.values()):
            conn.line.close()
