"""The control channel's transport: typed messages over TCP, admission by HMAC.

It carries admission (a challenge answered with an HMAC of the run token, so the token
never crosses the wire), heartbeats, and the coordinator's notifications (a new membership
epoch, the end of the run). Being a live connection, it is also a lease: when a worker
process dies its kernel closes the socket and the coordinator knows at once; a worker that
hangs keeps the socket open but stops beating, which the phi-accrual detector catches.

The wire format is :mod:`perdure.runtime.control.protocol`'s; this module only moves its
lines. The TCPStore stays the rendezvous for process groups; this channel only tells a
worker when to look.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import socket
import threading
from collections.abc import Callable

from perdure.runtime.control import protocol as p


def mac(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def verify(token: str, nonce: str, answer: str) -> bool:
    return hmac.compare_digest(mac(token, nonce), answer)


class LineSocket:
    """A socket that sends and receives protocol messages; sends are thread-safe."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = p.LineBuffer()
        self._lock = threading.Lock()
        self.queued: list[p.Message] = []

    def send(self, msg: p.Message) -> None:
        data = p.encode(msg)
        with self._lock:
            self.sock.sendall(data)

    def feed(self, data: bytes) -> list[p.Message]:
        """Add received bytes; return the complete messages they finish."""
        return self.buffer.feed(data)

    def recv(self, timeout_s: float) -> p.Message:
        """Block for the next message (used during admission only)."""
        self.sock.settimeout(timeout_s)
        try:
            while not self.queued:
                self.queued += self.feed(self.sock.recv(65536) or _eof())
            return self.queued.pop(0)
        finally:
            self.sock.settimeout(None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def _eof() -> bytes:
    raise ConnectionError("the coordinator closed the connection")


class AdmissionRefused(RuntimeError):
    """The coordinator refused this worker (wrong token, duplicate name, run over), or
    asked it to come back later (``retry``: a standby without the lease, a coordinator
    renewing its own or fenced out)."""

    def __init__(self, message: str, *, retry: bool = False) -> None:
        super().__init__(message)
        self.retry = retry


def connect(
    host: str, port: int, token: str, hello: Callable[[str], p.Hello], timeout_s: float
) -> tuple[LineSocket, p.Welcome]:
    """Open the channel and get admitted; ``hello(mac)`` builds the hello that answers
    the challenge. Returns the socket and the welcome."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    line = LineSocket(sock)
    try:
        challenge = line.recv(timeout_s)
        if not isinstance(challenge, p.Challenge):
            raise ConnectionError(
                f"coordinator {host}:{port} sent {challenge.type}, not a challenge"
            )
        line.send(hello(mac(token, challenge.nonce)))
        reply = line.recv(timeout_s)
    except (p.ProtocolError, OSError):
        line.close()
        raise
    if not isinstance(reply, p.Welcome):
        line.close()
        refused = reply if isinstance(reply, p.Refused) else None
        reason = refused.reason if refused else f"sent {reply.type}"
        retry = refused is not None and refused.retry
        raise AdmissionRefused(f"coordinator {host}:{port} refused: {reason}", retry=retry)
    return line, reply


class Listener(threading.Thread):
    """Reads the coordinator's messages on a daemon thread and hands them to ``on_message``;
    calls ``on_lost`` once when the connection ends (or the coordinator breaks the
    protocol, which is treated like a lost connection)."""

    def __init__(
        self,
        line: LineSocket,
        on_message: Callable[[p.Message], None],
        on_lost: Callable[[], None],
    ) -> None:
        super().__init__(daemon=True, name="coordinator-listener")
        self.line, self.on_message, self.on_lost = line, on_message, on_lost

    def run(self) -> None:
        for msg in self.line.queued:  # arrived together with the welcome
            self.on_message(msg)
        self.line.queued.clear()
        with contextlib.suppress(OSError, p.ProtocolError):
            while True:
                data = self.line.sock.recv(65536)
                if not data:
                    break
                for msg in self.line.feed(data):
                    self.on_message(msg)
        self.on_lost()
