"""The worker's side of fault injection: faults that act inside the process.

``kill``, ``hang`` and ``region_down`` are real signals sent by the launcher; ``delay`` and
``comm_error`` need the process's cooperation, so the launcher posts them under
``chaos/<worker>`` (or ``chaos/<region>``) in the store and the heartbeat thread picks them
up: a delay holds this worker's heartbeats and its data-plane sends for ``delay_ms``;
a comm error makes its next collective fail, as a dropped link would.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import torch.distributed as dist


class ChaosState:
    """In-process faults currently in force for this worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seen: dict[str, int] = {}
        self._delay_s = 0.0
        self._delay_until = 0.0
        self._comm_error = False

    def poll(self, store: dist.Store, name: str, region: str, events: Any) -> None:
        for key in (f"chaos/{name}", f"chaos/{region}"):
            if not store.check([key]):
                continue
            fault = json.loads(store.get(key))
            if fault["seq"] <= self._seen.get(key, 0):
                continue
            self._seen[key] = fault["seq"]
            self._apply(fault)

    def _apply(self, fault: dict[str, Any]) -> None:
        with self._lock:
            if fault["kind"] == "delay":
                self._delay_s = fault["delay_ms"] / 1000
                duration = fault.get("duration_s")
                self._delay_until = time.time() + duration if duration else float("inf")
            elif fault["kind"] == "comm_error":
                self._comm_error = True

    def delay_s(self) -> float:
        with self._lock:
            return self._delay_s if time.time() < self._delay_until else 0.0

    def take_comm_error(self) -> bool:
        with self._lock:
            hit, self._comm_error = self._comm_error, False
            return hit
