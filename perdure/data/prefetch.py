"""Background read-ahead of slot batches: one thread, a bounded table, bounded waits.

A prefetched batch is tagged with the loader's *generation* (bumped by every quarantine,
poisoning or restore); a batch whose generation is stale is discarded and recomputed, so
read-ahead can never serve samples that a decision made after the read would change.
Prefetch changes timing only: :meth:`take` returns ``None`` whenever it has nothing valid,
and the caller computes the batch itself.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from perdure.data.batch import Batch

log = logging.getLogger("perdure.data")

Key = tuple[int, int]


class Prefetcher:
    """Holds at most ``limit`` batches (pending or ready); waits at most ``timeout_s``."""

    def __init__(self, load: Callable[[int, int], Batch], limit: int, timeout_s: float) -> None:
        self._load, self.limit, self.timeout_s = load, limit, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="perdure-prefetch")
        self._table: dict[Key, tuple[int, Future[Batch]]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, step: int, slots: list[int], generation: int) -> None:
        with self._lock:
            if self._closed:
                return
            for key in [k for k in self._table if k[0] < step]:  # behind the reader: stale
                self._table.pop(key)[1].cancel()
            for slot in slots:
                key = (step, slot)
                if key in self._table or len(self._table) >= self.limit:
                    continue
                self._table[key] = (generation, self._pool.submit(self._load, step, slot))

    def take(self, step: int, slot: int, generation: int) -> Batch | None:
        with self._lock:
            entry = self._table.pop((step, slot), None)
        if entry is None or entry[0] != generation:
            return None
        try:
            return entry[1].result(timeout=self.timeout_s)
        except FutureTimeout:
            log.warning("data: prefetch of step %d slot %d not ready after %.1f s; reading "
                        "it in the foreground", step, slot, self.timeout_s)  # fmt: skip
        except Exception as e:  # the foreground read reports the error properly
            log.debug("data: prefetch of step %d slot %d failed: %s", step, slot, e)
        return None

    def invalidate(self) -> None:
        with self._lock:
            for _gen, fut in self._table.values():
                fut.cancel()
            self._table.clear()

    def pending(self) -> int:
        with self._lock:
            return len(self._table)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.invalidate()
        self._pool.shutdown(wait=True, cancel_futures=True)
