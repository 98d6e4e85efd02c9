"""The launcher's client of the run's store, through which fault injection posts what
must happen inside a worker (``chaos``: in-process faults)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist

STORE_TIMEOUT_S = 5.0
"""How long posting an in-process fault may wait for the store (the monitor loop waits)."""


class StoreClient:
    """The launcher's client of the run's store: the primary's, or the standby's once the
    primary is gone. Connected on first use only: a run without in-process faults never
    connects."""

    def __init__(self, addrs: list[tuple[str, int]], token: str) -> None:
        self.addrs = addrs  # the launcher's list, filled in as coordinators publish ports
        self.token = token
        self._at = 0
        self._store: dist.Store | None = None

    def set(self, key: str, value: str) -> bool:
        import torch.distributed as dist

        for _ in self.addrs:
            try:
                self._connected().set(key, value)
                return True
            except (RuntimeError, dist.DistError):  # that store is gone: try the next
                self._store = None
                self._at = (self._at + 1) % len(self.addrs)
        return False

    def _connected(self) -> dist.Store:
        from datetime import timedelta

        from perdure.runtime.control.auth_store import AuthStore

        if self._store is None:
            host, port = self.addrs[self._at]
            timeout = timedelta(seconds=STORE_TIMEOUT_S)
            self._store = AuthStore(host, port, self.token, timeout)
        return self._store


__all__ = ["STORE_TIMEOUT_S", "StoreClient"]
