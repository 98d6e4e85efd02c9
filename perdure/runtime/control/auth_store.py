"""The workers' side of the run's store: a ``torch.distributed.Store`` behind the token.

``store.py`` is the server (in the coordinator, which never imports torch); this is the
client that ``PrefixStore``, ``ProcessGroupGloo`` and ``ProcessGroupNCCL`` use as they
would a ``TCPStore``. The wire format is ``store_wire.py``'s.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from perdure.runtime.control.store_wire import (
    StoreProtocolError,
    as_bytes,
    handshake,
    recv_frame,
    send_frame,
)

__all__ = ["RETRY_S", "AuthStore"]

RETRY_S = 10.0
"""How long a client keeps trying when the server accepted its connection and then closed
it before its verdict (dropped as the oldest pending one under a flood): at most its own
timeout. A refusal or a closed port fails at once."""


class AuthStore(dist.Store):
    """A ``torch.distributed.Store`` that talks to a ``store.StoreServer`` with the token.

    Thread-safe (one operation at a time on its connection); raises
    ``torch.distributed.DistStoreError`` for a timed-out wait or a missing key and
    ``DistNetworkError`` when the server is unreachable, as ``TCPStore`` does, so callers
    handle both the same way.
    """

    def __init__(self, host: str, port: int, token: str, timeout: timedelta) -> None:
        super().__init__()
        self.host, self.port, self._timeout = host, port, timeout
        self._lock = threading.Lock()
        self._sock = self._admitted(token)

    def _admitted(self, token: str) -> socket.socket:
        """A connection that proved the token; retried (up to ``RETRY_S``) only when the
        server accepted it and closed it before its verdict, or said it was crowded out
        (``retry``: its cap or deadline, as under a flood); a wrong token is final."""
        limit = self._timeout.total_seconds()
        end = time.monotonic() + min(limit, RETRY_S)
        pause = 0.02
        while True:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=limit)
            except OSError as e:
                msg = f"store {self.host}:{self.port} unreachable: {e}"
                raise dist.DistNetworkError(msg) from e
            try:
                reply = handshake(sock, token)
            except (OSError, ConnectionError, StoreProtocolError, struct.error) as e:
                reply = {"ok": False, "error": f"unreachable: {e}", "retry": True}
            if not reply.get("ok") and reply.get("retry") is True:  # a crowded door
                sock.close()
                if time.monotonic() + pause >= end:
                    msg = f"store {self.host}:{self.port} {reply.get('error')}"
                    raise dist.DistNetworkError(msg)
                time.sleep(pause)
                pause = min(0.5, pause * 2)
                continue
            if not reply.get("ok"):
                sock.close()
                msg = f"store {self.host}:{self.port} refused: {reply.get('error')}"
                raise dist.DistNetworkError(msg)
            return sock

    # -- the Store interface ---------------------------------------------------------------

    def set(self, key: str, value: Any) -> None:
        self._call({"op": "set", "keys": [key]}, (as_bytes(value),))

    def get(self, key: str) -> bytes:
        ms = self._ms(None)
        return self._call({"op": "get", "keys": [key], "timeout_ms": ms}, extra_s=ms / 1000)[1][0]

    def add(self, key: str, value: int) -> int:
        return int(self._call({"op": "add", "keys": [key], "n": int(value)})[0]["n"])

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        blobs = (as_bytes(expected), as_bytes(desired))
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
                send_frame(self._sock, header, blobs)
                reply, out = recv_frame(self._sock)
            except (OSError, ConnectionError, StoreProtocolError, struct.error) as e:
                self.close()
                raise dist.DistNetworkError(f"store {self.host}:{self.port}: {e}") from e
        if not reply.get("ok"):
            raise dist.DistStoreError(str(reply.get("error")))
        return reply, out
