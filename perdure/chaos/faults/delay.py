"""``delay``: a latency spike on a worker's or a region's traffic."""

from __future__ import annotations

from typing import TYPE_CHECKING

from perdure import events as ev
from perdure.chaos import message
from perdure.chaos.faults.base import Fault, Record, run_ended

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl
    from perdure.config import Checker


class Delay(Fault):
    """Extra latency (``delay_ms``) on each heartbeat and data-plane send of a worker or
    region for ``duration_s`` (posted in the store, applied by the worker): nobody is
    evicted; the planner benches the lagging member (its heartbeats show the lag) and plans
    it back in once its link is back to speed."""

    kind = "delay"
    failure_class = "network"
    target = "worker_or_region"
    in_process = True
    timed = True

    def validate(self, fault: FaultConfig, c: Checker) -> None:
        super().validate(fault, c)
        c.positive("delay_ms", fault.delay_ms)

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        fields = {"delay_ms": fault.delay_ms, "duration_s": fault.duration_s}
        message.post(control, fault.target, self.kind, **fields)
        return []

    def detected(self, e: Record, fault: Record, region_workers: set[str]) -> bool:
        """The planner benched the lagging member (or moved slots away from it)."""
        if e["event"] == ev.MEMBER_BENCHED:
            return e.get("worker") == fault["target"] or e.get("worker") in region_workers
        return e["event"] == ev.EPOCH_ANNOUNCED and e.get("reason") == "rebalance"

    def absorbed(self, fault: Record, events: list[Record], detect: Record | None) -> bool:
        """A spike shorter than the detection horizon must evict nobody."""
        evicted = any(
            e["event"] == ev.LEAVE and e.get("worker") == fault["target"] and e["t"] >= fault["t"]
            for e in events
        )
        return run_ended(events) and not evicted
