"""The run's rendezvous store, behind the run token: no token, no key read or written.

torch's ``TCPStore`` has no authentication and its server listens on every interface, so
anyone who can reach the port can list, read, write and delete the keys that process
groups rendezvous through (and, before this module, inject faults). Here the keys live
in a ``MemoryStore`` (``store_memory.py``: ``HashStore``'s semantics in plain Python, so
that the coordinator never imports torch) inside the coordinator, served by
:class:`StoreServer` on the configured address only; each connection first answers a
challenge with an HMAC of the run token, like the control channel. Workers talk to it
through ``auth_store.AuthStore``, a ``torch.distributed.Store`` subclass, so
``PrefixStore``, ``ProcessGroupGloo`` and ``ProcessGroupNCCL`` use it as they would a
``TCPStore``.

Wire format (``store_wire.py``): frames of a 4-byte big-endian length and a body; a
body is a JSON header line and then raw bytes (the values). Admission: the server sends a
frame ``{"nonce"}``, the client answers with exactly ``AUTH_BYTES`` raw bytes
(``AUTH_MAGIC`` and the hex HMAC of the nonce; a fixed size, so that nothing larger is
read before the token is proved), the server replies ``{"ok": true}`` or ``{"ok": false,
"error"}``. Admission has a deadline (``ADMISSION_S`` from accept), a cap of its own
(``MAX_PENDING``, well below ``MAX_CLIENTS``) and costs no thread; see
:class:`StoreServer`. After it, a request header is
``{"op", "keys", "sizes", "timeout_ms", "n"}``; a reply header ``{"ok", "sizes", "n"}``
or ``{"ok": false, "error", "timeout": bool}``. Frames are bounded (``MAX_FRAME``), every
socket operation has a timeout, and a client that breaks the format is disconnected.

Cost: one round trip per store operation, as with TCPStore (forming a gloo group of W
members takes W+1 operations per member; see ``benchmarks/bench_store.py``).
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import selectors
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from perdure.runtime.control.channel import verify
from perdure.runtime.control.refusals import Refusals
from perdure.runtime.control.store_memory import MemoryStore, StoreTimeout, StoreValueError
from perdure.runtime.control.store_wire import (
    AUTH_BYTES,
    AUTH_MAGIC,
    StoreProtocolError,
    as_int,
    frame,
    parse_request,
    recv_frame,
    send_frame,
)

log = logging.getLogger("perdure.store")

MAX_CLIENTS = 1024
"""Authenticated clients at once (a thread each)."""
MAX_PENDING = 64
"""Connections that have not proved the token yet, at once; a new one drops the oldest. A
worker's answer takes one round trip, so a flood that turns this many over in less than
that is needed to keep one out (and its client retries: ``auth_store.RETRY_S``)."""
ADMISSION_S = 5.0
"""From accept to a checked answer, whatever the peer sends meanwhile (a deadline, not a
per-read timeout: dribbling one byte at a time does not extend it)."""
BACKLOG = 1024
SELECT_S = 0.1
ACCEPT_BATCH = 256
IDLE_S = 3600.0
"""A connection that sends nothing for this long is closed (workers reconnect)."""


# -- the server ------------------------------------------------------------------------------


@dataclass
class _Pending:
    """A connection that has not proved the token yet."""

    sock: socket.socket
    nonce: str
    since: float
    got: bytearray = field(default_factory=bytearray)


class StoreServer:
    """Serves a ``MemoryStore`` to clients that prove the run token.

    Admission runs on one thread over non-blocking sockets (a selector), so a connection
    that has not proved the token costs a socket and a few bytes, never a thread: at most
    ``MAX_PENDING`` of them at once (the oldest is dropped for a new one: a flood cannot
    keep a worker's connection out, whose answer takes one round trip), each closed
    ``ADMISSION_S`` after its accept whatever it sends, and none read beyond the
    ``AUTH_BYTES`` of its answer before it is checked. An authenticated client gets a
    thread of its own (at most ``MAX_CLIENTS``). Refusals are counted in ``refusals``
    (the coordinator logs them, one record per interval).
    """

    def __init__(self, host: str, port: int, token: str) -> None:
        self.token = token
        self.backend = MemoryStore()
        try:
            self.listener = socket.create_server((host, port), backlog=BACKLOG)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot listen on {host}:{port} (--store-port / --host): {e.strerror}"
            ) from None
        self.listener.setblocking(False)
        self.refusals = Refusals("store")
        self.unauthenticated_bytes = 0
        """Bytes read from connections before they proved the token (a bound's evidence)."""
        self._pending: dict[socket.socket, _Pending] = {}  # in accept order: oldest first
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.listener, selectors.EVENT_READ, None)
        self._clients: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._admit_loop, name="store-admit", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    @property
    def pending(self) -> int:
        """Connections waiting to prove the token now."""
        return len(self._pending)

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5)
        with contextlib.suppress(OSError):
            self.listener.close()
        for pend in list(self._pending.values()):
            pend.sock.close()
        with self._lock:
            for s in list(self._clients):
                with contextlib.suppress(OSError):
                    s.close()

    # -- admission (one thread, non-blocking) ----------------------------------------------

    def _admit_loop(self) -> None:
        try:
            while not self._closed.is_set():
                for key, _ in self._sel.select(timeout=SELECT_S):
                    if key.data is None:
                        self._accept_some()
                    else:
                        self._on_answer(key.data)
                self._expire(time.monotonic())
        finally:
            self._sel.close()

    def _accept_some(self) -> None:
        for _ in range(ACCEPT_BATCH):  # then expire and read answers: no starvation
            try:
                sock, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, a reset in the queue: next turn
                log.debug("store accept: %s", e)
                return
            now = time.monotonic()
            if len(self._pending) >= MAX_PENDING:
                oldest = next(iter(self._pending.values()))
                self._refuse(oldest, "too many unauthenticated connections", now, crowded=True)
            self._greet(sock, now)

    def _greet(self, sock: socket.socket, now: float) -> None:
        nonce = secrets.token_hex(16)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.send(frame({"nonce": nonce}))  # a few dozen bytes: an empty buffer takes it
        except OSError:
            sock.close()
            return
        pend = _Pending(sock, nonce, now)
        self._pending[sock] = pend
        self._sel.register(sock, selectors.EVENT_READ, pend)

    def _on_answer(self, pend: _Pending) -> None:
        now = time.monotonic()
        try:
            data = pend.sock.recv(AUTH_BYTES - len(pend.got))
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:  # it left (a port probe): nothing to refuse
            self._forget(pend)
            pend.sock.close()
            return
        self.unauthenticated_bytes += len(data)
        pend.got += data
        if not AUTH_MAGIC.startswith(bytes(pend.got[: len(AUTH_MAGIC)])):
            self._refuse(pend, "not a store client's answer", now)
        elif len(pend.got) == AUTH_BYTES:
            answer = bytes(pend.got[len(AUTH_MAGIC) :]).decode("ascii", "replace")
            if verify(self.token, pend.nonce, answer):
                self._hand_over(pend, now)
            else:
                self._refuse(pend, "bad run token", now)

    def _expire(self, now: float) -> None:
        for pend in list(self._pending.values()):  # oldest first: stop at the first young one
            if now - pend.since <= ADMISSION_S:
                return
            self._refuse(pend, f"no answer within {ADMISSION_S:g} s", now, crowded=True)

    def _forget(self, pend: _Pending) -> None:
        self._pending.pop(pend.sock, None)
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._sel.unregister(pend.sock)

    def _refuse(self, pend: _Pending, reason: str, now: float, *, crowded: bool = False) -> None:
        """Count, tell the peer (best effort, never blocking) and close. ``crowded``: the
        door's cap or deadline, not the peer's answer, refused it (it may try again)."""
        self._forget(pend)
        self.refusals.note(reason, now)
        with contextlib.suppress(OSError):
            if crowded:  # the door was crowded, not the answer wrong: it may try again
                error = f"not admitted ({reason})"
                pend.sock.send(frame({"ok": False, "error": error, "retry": True}))
            else:
                error = reason if reason == "bad run token" else f"bad run token ({reason})"
                pend.sock.send(frame({"ok": False, "error": error}))
        pend.sock.close()

    def _hand_over(self, pend: _Pending, now: float) -> None:
        self._forget(pend)
        with self._lock:
            full = len(self._clients) >= MAX_CLIENTS
            if not full:
                self._clients.add(pend.sock)
        if full:
            self.refusals.note(f"{MAX_CLIENTS} clients already connected", now)
            with contextlib.suppress(OSError):
                error = f"the store serves {MAX_CLIENTS} clients already"
                pend.sock.send(frame({"ok": False, "error": error}))
            pend.sock.close()
            return
        threading.Thread(target=self._serve, args=(pend.sock,), daemon=True).start()

    # -- an authenticated client (a thread each) -------------------------------------------

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.setblocking(True)
            sock.settimeout(IDLE_S)
            send_frame(sock, {"ok": True})
            while not self._closed.is_set():
                header, blobs = recv_frame(sock)
                reply, out = self._execute(header, blobs)
                send_frame(sock, reply, tuple(out))
        except (OSError, ConnectionError, StoreProtocolError, struct.error) as e:
            log.debug("store client closed: %s", e)
        finally:
            with self._lock:
                self._clients.discard(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _execute(
        self, header: dict[str, Any], blobs: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        try:
            op, keys = parse_request(header, blobs)
            return self._run(op, keys, header, blobs)
        except StoreProtocolError as e:
            return {"ok": False, "error": str(e), "timeout": False}, []
        except StoreTimeout as e:  # a wait that timed out
            return {"ok": False, "error": str(e)[:300], "timeout": True}, []
        except StoreValueError as e:  # an add to a value that is not a number
            return {"ok": False, "error": str(e)[:300], "timeout": False}, []

    def _run(
        self, op: str, keys: list[str], header: dict[str, Any], blobs: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        b = self.backend
        if op == "set":
            b.set(keys[0], blobs[0])
        elif op == "get":  # wait first: a missing key is a wait that timed out
            b.wait(keys[:1], as_int(header.get("timeout_ms"), lo=1) / 1000)
            return {"ok": True}, [b.get(keys[0])]
        elif op == "add":
            return {"ok": True, "n": b.add(keys[0], as_int(header.get("n")))}, []
        elif op == "check":
            return {"ok": True, "n": int(b.check(keys))}, []
        elif op == "wait":
            b.wait(keys, as_int(header.get("timeout_ms"), lo=1) / 1000)
        elif op == "delete_key":
            return {"ok": True, "n": int(b.delete_key(keys[0]))}, []
        elif op == "compare_set":
            new = b.compare_set(keys[0], blobs[0], blobs[1])
            return {"ok": True}, [new]
        else:
            return {"ok": True, "n": b.num_keys()}, []
        return {"ok": True}, []
