"""The control channel between a worker and the coordinator: JSON lines over TCP.

It carries admission (a challenge answered with an HMAC of the run token, so the token
never crosses the wire), heartbeats, and the coordinator's notifications (a new membership
epoch, the end of the run). Being a live connection, it is also a lease: when a worker
process dies its kernel closes the socket and the coordinator knows at once; a worker that
hangs keeps the socket open but stops beating, which the phi-accrual detector catches.

The TCPStore stays the rendezvous for process groups and holds the published epochs; this
channel only tells a worker when to look.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

Message = dict[str, Any]


def mac(token: str, nonce: str) -> str:
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def verify(token: str, nonce: str, answer: str) -> bool:
    return hmac.compare_digest(mac(token, nonce), answer)


class LineSocket:
    """A socket that sends and receives one JSON object per line; sends are thread-safe."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._buf = b""
        self._lock = threading.Lock()
        self.queued: list[Message] = []

    def send(self, msg: Message) -> None:
        data = (json.dumps(msg, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self.sock.sendall(data)

    def feed(self, data: bytes) -> list[Message]:
        """Add received bytes; return the complete messages they finish."""
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def recv(self, timeout_s: float) -> Message:
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
    """The coordinator refused this worker (wrong token, duplicate name, run over)."""


def connect(
    host: str, port: int, token: str, hello: Message, timeout_s: float
) -> tuple[LineSocket, Message]:
    """Open the channel and get admitted; returns the socket and the welcome message."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    line = LineSocket(sock)
    challenge = line.recv(timeout_s)
    line.send({**hello, "type": "hello", "mac": mac(token, challenge["nonce"])})
    reply = line.recv(timeout_s)
    if reply.get("type") != "welcome":
        line.close()
        raise AdmissionRefused(f"coordinator {host}:{port} refused: {reply.get('reason')}")
    return line, reply


class Listener(threading.Thread):
    """Reads the coordinator's messages on a daemon thread and hands them to ``on_message``;
    calls ``on_lost`` once when the connection ends."""

    def __init__(
        self, line: LineSocket, on_message: Callable[[Message], None], on_lost: Callable[[], None]
    ) -> None:
        super().__init__(daemon=True, name="coordinator-listener")
        self.line, self.on_message, self.on_lost = line, on_message, on_lost

    def run(self) -> None:
        for msg in self.line.queued:  # arrived together with the welcome
            self.on_message(msg)
        self.line.queued.clear()
        try:
            while True:
                data = self.line.sock.recv(65536)
                if not data:
                    break
                for msg in self.line.feed(data):
                    self.on_message(msg)
        except OSError:
            pass
        self.on_lost()
