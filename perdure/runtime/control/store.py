"""The run's rendezvous store, behind the run token: no token, no key read or written.

torch's ``TCPStore`` has no authentication and its server listens on every interface, so
anyone who can reach the port can list, read, write and delete the keys that process
groups rendezvous through (and, before this module, inject faults). Here the keys live
in a ``HashStore`` (torch's own in-memory store) inside the coordinator, served by
:class:`StoreServer` on the configured address only; each connection first answers a
challenge with an HMAC of the run token, like the control channel. Workers talk to it
through :class:`AuthStore`, a ``torch.distributed.Store`` subclass, so ``PrefixStore``,
``ProcessGroupGloo`` and ``ProcessGroupNCCL`` use it as they would a ``TCPStore``.

Wire format (owned by this module): frames of a 4-byte big-endian length and a body; a
body is a JSON header line and then raw bytes (the values). A request header is
``{"op", "keys", "sizes", "timeout_ms", "n"}``; a reply header ``{"ok", "sizes", "n"}``
or ``{"ok": false, "error", "timeout": bool}``. Frames are bounded (``MAX_FRAME``), every
socket operation has a timeout, and a client that breaks the format is disconnected.

Cost: one round trip per store operation, as with TCPStore (forming a gloo group of W
members takes W+1 operations per member; see ``benchmarks/bench_store.py``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import socket
import struct
import threading
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from perdure.runtime.control.channel import mac, verify

log = logging.getLogger("perdure.store")

MAX_FRAME = 64 << 20
"""Bytes in one frame (the checkpoint commit's payloads are the largest values)."""
MAX_KEYS = 4096
MAX_CLIENTS = 1024
ADMISSION_S = 10.0
IDLE_S = 3600.0
"""A connection that sends nothing for this long is closed (workers reconnect)."""
_OPS = ("set", "get", "add", "check", "wait", "delete_key", "compare_set", "num_keys")


class StoreProtocolError(ValueError):
    """A frame that is not a valid request or reply."""


# -- frames ----------------------------------------------------------------------------------


def _send_frame(sock: socket.socket, header: dict[str, Any], blobs: tuple[bytes, ...] = ()) -> None:
    head = json.dumps({**header, "sizes": [len(b) for b in blobs]}).encode() + b"\n"
    body = head + b"".join(blobs)
    sock.sendall(struct.pack(">I", len(body)) + body)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the store connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_frame(sock: socket.socket) -> tuple[dict[str, Any], list[bytes]]:
    (size,) = struct.unpack(">I", _recv_exact(sock, 4))
    if size > MAX_FRAME:
        raise StoreProtocolError(f"frame of {size} bytes exceeds {MAX_FRAME}")
    body = _recv_exact(sock, size)
    head, sep, rest = body.partition(b"\n")
    try:
        header = json.loads(head.decode("utf-8")) if sep else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    if not isinstance(header, dict):
        raise StoreProtocolError("a frame starts with a JSON object line")
    sizes = header.get("sizes", [])
    valid = isinstance(sizes, list) and len(sizes) <= 2 * MAX_KEYS
    if (
        not valid
        or not all(isinstance(s, int) and s >= 0 for s in sizes)
        or sum(sizes) != len(rest)
    ):
        raise StoreProtocolError("frame sizes do not match its body")
    blobs, at = [], 0
    for s in sizes:
        blobs.append(rest[at : at + s])
        at += s
    return header, blobs


# -- the server ------------------------------------------------------------------------------


class StoreServer:
    """Serves a ``HashStore`` to clients that prove the run token; one thread a client."""

    def __init__(self, host: str, port: int, token: str) -> None:
        self.token = token
        self.backend = dist.HashStore()
        try:
            self.listener = socket.create_server((host, port))
        except OSError as e:
            raise OSError(
                e.errno, f"cannot listen on {host}:{port} (--store-port / --host): {e.strerror}"
            ) from None
        self.listener.settimeout(0.2)
        self._clients: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name="store-accept", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self.listener.getsockname()[1])

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self.listener.close()
        with self._lock:
            for s in list(self._clients):
                with contextlib.suppress(OSError):
                    s.close()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                if len(self._clients) >= MAX_CLIENTS:
                    sock.close()
                    continue
                self._clients.add(sock)
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._admit(sock):
                sock.settimeout(IDLE_S)
                while not self._closed.is_set():
                    header, blobs = _recv_frame(sock)
                    reply, out = self._execute(header, blobs)
                    _send_frame(sock, reply, tuple(out))
        except (OSError, ConnectionError, StoreProtocolError, struct.error) as e:
            log.debug("store client closed: %s", e)
        finally:
            with self._lock:
                self._clients.discard(sock)
            with contextlib.suppress(OSError):
                sock.close()

    def _admit(self, sock: socket.socket) -> bool:
        sock.settimeout(ADMISSION_S)
        nonce = secrets.token_hex(16)
        _send_frame(sock, {"nonce": nonce})
        header, _ = _recv_frame(sock)
        answer = header.get("mac")
        ok = isinstance(answer, str) and verify(self.token, nonce, answer)
        _send_frame(sock, {"ok": ok} if ok else {"ok": False, "error": "bad run token"})
        return ok

    def _execute(
        self, header: dict[str, Any], blobs: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        try:
            op, keys = _request(header, blobs)
            return self._run(op, keys, header, blobs)
        except StoreProtocolError as e:
            return {"ok": False, "error": str(e), "timeout": False}, []
        except dist.DistStoreError as e:  # a wait that timed out, a missing key
            return {"ok": False, "error": str(e).splitlines()[0][:300], "timeout": True}, []

    def _run(
        self, op: str, keys: list[str], header: dict[str, Any], blobs: list[bytes]
    ) -> tuple[dict[str, Any], list[bytes]]:
        b = self.backend
        if op == "set":
            b.set(keys[0], blobs[0])  # type: ignore[arg-type]  # bytes are accepted
        elif op == "get":  # wait first: HashStore.get would block for its own timeout
            b.wait(keys, timedelta(milliseconds=_int(header.get("timeout_ms"), lo=1)))
            return {"ok": True}, [b.get(keys[0])]
        elif op == "add":
            return {"ok": True, "n": b.add(keys[0], _int(header.get("n")))}, []
        elif op == "check":
            return {"ok": True, "n": int(b.check(keys))}, []
        elif op == "wait":
            b.wait(keys, timedelta(milliseconds=_int(header.get("timeout_ms"), lo=1)))
        elif op == "delete_key":
            return {"ok": True, "n": int(b.delete_key(keys[0]))}, []
        elif op == "compare_set":
            new = b.compare_set(keys[0], blobs[0], blobs[1])  # type: ignore[arg-type]
            return {"ok": True}, [new]
        else:
            return {"ok": True, "n": b.num_keys()}, []
        return {"ok": True}, []


def _request(header: dict[str, Any], blobs: list[bytes]) -> tuple[str, list[str]]:
    op, keys = header.get("op"), header.get("keys", [])
    if op not in _OPS:
        raise StoreProtocolError(f"unknown store operation {str(op)[:40]!r}")
    if (
        not isinstance(keys, list)
        or len(keys) > MAX_KEYS
        or not all(isinstance(k, str) for k in keys)
    ):
        raise StoreProtocolError("keys must be a list of strings")
    need = {
        "set": (1, 1),
        "compare_set": (1, 2),
        "get": (1, 0),
        "add": (1, 0),
        "delete_key": (1, 0),
    }
    n_keys, n_blobs = need.get(op, (len(keys), 0))
    if (op in need and len(keys) != n_keys) or len(blobs) != n_blobs:
        raise StoreProtocolError(f"{op}: wrong number of keys or values")
    return op, keys


def _int(value: Any, lo: int = -(1 << 62)) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value < 1 << 62:
        raise StoreProtocolError(f"expected an integer, got {str(value)[:40]}")
    return value


# -- the client ------------------------------------------------------------------------------


class AuthStore(dist.Store):
    """A ``torch.distributed.Store`` that talks to a :class:`StoreServer` with the token.

    Thread-safe (one operation at a time on its connection); raises
    ``torch.distributed.DistStoreError`` for a timed-out wait or a missing key and
    ``DistNetworkError`` when the server is unreachable, as ``TCPStore`` does, so callers
    handle both the same way.
    """

    def __init__(self, host: str, port: int, token: str, timeout: timedelta) -> None:
        super().__init__()
        self.host, self.port, self._timeout = host, port, timeout
        self._lock = threading.Lock()
        try:
            self._sock = socket.create_connection((host, port), timeout=timeout.total_seconds())
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header, _ = _recv_frame(self._sock)
            _send_frame(self._sock, {"mac": mac(token, str(header.get("nonce", "")))})
            reply, _ = _recv_frame(self._sock)
        except (OSError, ConnectionError, StoreProtocolError, struct.error) as e:
            raise dist.DistNetworkError(f"store {host}:{port} unreachable: {e}") from e
        if not reply.get("ok"):
            self._sock.close()
            raise dist.DistNetworkError(f"store {host}:{port} refused: {reply.get('error')}")

    # -- the Store interface ---------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._call({"op": "set", "keys": [key]}, (_bytes(value),))

    def get(self, key: str) -> bytes:
        ms = self._ms(None)
        return self._call({"op": "get", "keys": [key], "timeout_ms": ms}, extra_s=ms / 1000)[1][0]

    def add(self, key: str, value: int) -> int:
        return int(self._call({"op": "add", "keys": [key], "n": int(value)})[0]["n"])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        blobs = (_bytes(expected), _bytes(desired))
        return self._call({"op": "compare_set", "keys": [key]}, blobs)[1][0]

    def check(self, keys: list[str]) -> bool:
        return bool(self._call({"op": "check", "keys": list(keys)})[0]["n"])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        ms = self._ms(timeout)
        self._call({"op": "wait", "keys": list(keys), "timeout_ms": ms}, extra_s=ms / 1000)

    def _ms(self, timeout: timedelta | None) -> int:
        t = timeout if timeout is not None else self._timeout
        return max(1, int(t.total_seconds() * 1000))

    def delete_key(self, key: str) -> bool:
        return bool(self._call({"op": "delete_key", "keys": [key]})[0]["n"])

    def num_keys(self) -> int:
        return int(self._call({"op": "num_keys"})[0]["n"])

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout

    @property
    def timeout(self) -> timedelta:  # type: ignore[override]
        return self._timeout

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()

    # -- one round trip --------------------------------------------------------------------

    def _call(
        self,
        header: dict[str, Any],
        blobs: tuple[bytes, ...] = (),
        extra_s: float = 0.0,
    ) -> tuple[dict[str, Any], list[bytes]]:
        with self._lock:
            try:
                self._sock.settimeout(extra_s + 10.0)
                _send_frame(self._sock, header, blobs)
                reply, out = _recv_frame(self._sock)
            except (OSError, ConnectionError, StoreProtocolError, struct.error) as e:
                self.close()
                raise dist.DistNetworkError(f"store {self.host}:{self.port}: {e}") from e
        if not reply.get("ok"):
            raise dist.DistStoreError(str(reply.get("error")))
        return reply, out


def _bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list | bytearray):
        return bytes(value)
    raise TypeError(f"store values are bytes or str, not {type(value).__name__}")
