"""The rendezvous store's wire format (``store.py`` serves it, its client speaks it).

Frames of a 4-byte big-endian length and a body; a body is a JSON header line and then
raw bytes (the values). Admission: the server sends a frame ``{"nonce"}``, the client
answers with exactly ``AUTH_BYTES`` raw bytes (``AUTH_MAGIC`` and the hex HMAC of the
nonce; a fixed size, so that nothing larger is read before the token is proved), the
server replies ``{"ok": true}`` or ``{"ok": false, "error"}``. After it, a request header
is ``{"op", "keys", "sizes", "timeout_ms", "n"}``; a reply header ``{"ok", "sizes", "n"}``
or ``{"ok": false, "error", "timeout": bool}``. Frames are bounded (``MAX_FRAME``), and a
frame that breaks the format raises :class:`StoreProtocolError`. No torch here.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

from perdure.runtime.control.channel import mac

MAX_FRAME = 64 << 20
"""Bytes in one frame (the checkpoint commit's payloads are the largest values)."""
MAX_KEYS = 4096
AUTH_MAGIC = b"PDS1"
"""The answer's first bytes: this format's version (a TCPStore's bytes fail here)."""
AUTH_BYTES = len(AUTH_MAGIC) + 64
"""The client's answer to the challenge: ``AUTH_MAGIC`` and the hex HMAC of the nonce.
Fixed size: the server reads no more than this from a peer before checking it."""
MAX_HANDSHAKE_FRAME = 4096
"""The client's bound on the server's challenge and verdict frames."""
OPS = ("set", "get", "add", "check", "wait", "delete_key", "compare_set", "num_keys")


class StoreProtocolError(ValueError):
    """A frame that is not a valid request or reply."""


# -- frames ----------------------------------------------------------------------------------


def frame(header: dict[str, Any], blobs: tuple[bytes, ...] = ()) -> bytes:
    head = json.dumps({**header, "sizes": [len(b) for b in blobs]}).encode() + b"\n"
    body = head + b"".join(blobs)
    return struct.pack(">I", len(body)) + body


def send_frame(sock: socket.socket, header: dict[str, Any], blobs: tuple[bytes, ...] = ()) -> None:
    sock.sendall(frame(header, blobs))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise ConnectionError("the store connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket, limit: int = MAX_FRAME) -> tuple[dict[str, Any], list[bytes]]:
    (size,) = struct.unpack(">I", recv_exact(sock, 4))
    if size > limit:
        raise StoreProtocolError(f"frame of {size} bytes exceeds {limit}")
    body = recv_exact(sock, size)
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


def parse_request(header: dict[str, Any], blobs: list[bytes]) -> tuple[str, list[str]]:
    op, keys = header.get("op"), header.get("keys", [])
    if op not in OPS:
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


def as_int(value: Any, lo: int = -(1 << 62)) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value < 1 << 62:
        raise StoreProtocolError(f"expected an integer, got {str(value)[:40]}")
    return value


def handshake(sock: socket.socket, token: str) -> dict[str, Any]:
    """Answer the server's challenge; its verdict's header."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    header, _ = recv_frame(sock, MAX_HANDSHAKE_FRAME)
    nonce = header.get("nonce")
    if not isinstance(nonce, str):
        raise StoreProtocolError("the server's first frame is not a challenge")
    sock.sendall(AUTH_MAGIC + mac(token, nonce).encode())
    reply, _ = recv_frame(sock, MAX_HANDSHAKE_FRAME)
    return reply


def as_bytes(value: Any) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode()
    if isinstance(value, list | bytearray):
        return bytes(value)
    raise TypeError(f"store values are bytes or str, not {type(value).__name__}")
