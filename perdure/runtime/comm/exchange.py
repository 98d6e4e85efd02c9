"""A small all-gather of JSON payloads over the store, for the parallel checkpoint commit.

It can run on any thread (each thread gets its own store client) and gives up when the
membership epoch changes instead of waiting out its timeout.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

CALL_TIMEOUT_S = 5.0
"""Most one store call of an exchange may wait (the exchange itself waits ``timeout_s``)."""


class StoreExchange:
    """``exchange(payload) -> [payload of rank 0, ..., payload of rank W-1]``."""

    def __init__(
        self,
        connect: Callable[[float], dist.Store],
        prefix: str,
        rank: int,
        world: int,
        should_abort: Callable[[], bool],
        timeout_s: float = 120.0,
    ) -> None:
        self.connect, self.prefix = connect, prefix
        self.rank, self.world = rank, world
        self.should_abort, self.timeout_s = should_abort, timeout_s
        self._local = threading.local()

    def _store(self) -> dist.Store:
        store = getattr(self._local, "store", None)
        if store is None:
            # Each call is bounded on its own: a store whose host hangs (a stopped
            # coordinator) must fail this save in seconds, not hold the epoch's close.
            store = self.connect(min(self.timeout_s, CALL_TIMEOUT_S))
            self._local.store = store
        return store

    def __call__(self, payload: dict[str, Any]) -> list[dict[str, Any]]:
        store = self._store()
        base = f"{self.prefix}ckx/{payload['round']}/"
        store.set(base + str(self.rank), json.dumps(payload))
        keys = [base + str(r) for r in range(self.world)]
        end = time.monotonic() + self.timeout_s
        while not store.check(keys):
            if self.should_abort():
                raise RuntimeError(f"checkpoint exchange {payload['round']}: membership changed")
            if time.monotonic() > end:
                raise TimeoutError(f"checkpoint exchange {payload['round']}: timed out")
            time.sleep(0.005)
        return [json.loads(store.get(k)) for k in keys]
