"""``slow_storage``: a worker's dataset reads stall."""

from __future__ import annotations

from typing import TYPE_CHECKING

from perdure import events as ev
from perdure.chaos import message
from perdure.chaos.faults.base import Fault, Record, run_ended

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl
    from perdure.config import Checker


class SlowStorage(Fault):
    """Every read of a slot's samples by a worker (or a region's workers) waits
    ``delay_ms`` longer for ``duration_s``, as a slow or contended dataset store would
    (posted in the store, applied by the worker's loader). The prefetch, reading a step
    ahead, hides what fits in a step; the rest slows the member, and the planner moves
    slots away from it as from any slow member. Timing only: the bits do not change."""

    kind = "slow_storage"
    failure_class = "hardware"
    target = "worker_or_region"
    in_process = True
    timed = True
    replans = False

    def validate(self, fault: FaultConfig, c: Checker) -> None:
        super().validate(fault, c)
        c.positive("delay_ms", fault.delay_ms)

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        fields = {"delay_ms": fault.delay_ms, "duration_s": fault.duration_s}
        message.post(control, fault.target, self.kind, **fields)
        return []

    def detected(self, e: Record, fault: Record, region_workers: set[str]) -> bool:
        """A worker of the target applied it to its reads."""
        hit = {fault["target"]} | region_workers
        return e["event"] == ev.FAULT_HIT and e.get("kind") == self.kind and e.get("worker") in hit

    def absorbed(self, fault: Record, events: list[Record], detect: Record | None) -> bool:
        """Slow reads must evict nobody."""
        hit = fault["target"]
        evicted = any(
            e["event"] == ev.LEAVE and e.get("worker") == hit and e["t"] >= fault["t"]
            for e in events
        )
        return run_ended(events) and detect is not None and not evicted
