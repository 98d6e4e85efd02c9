"""``corrupt_part``: one data part's stored copy reads corrupt."""

from __future__ import annotations

from typing import TYPE_CHECKING

from perdure import events as ev
from perdure.chaos.faults.base import Fault, Record, run_ended

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl
    from perdure.config import Checker


CORRUPT_PART = "corrupt_part"
"""The kind's name, for the code that applies it (the worker's loaders, preflight)."""


class CorruptPart(Fault):
    """From ``at_step`` on, every read of one part's primary copy has a byte flipped (a
    corrupt disk, a bad transfer), applied by every loader at exactly that step; the
    file itself is untouched. The data store reads it again, then repairs it from
    ``data.mirrors`` (the same bits: a ``part_repaired`` event); with no good copy,
    ``data.on_corrupt`` stops the run before the part is trained on, or quarantines it
    (a decision of kind ``corrupt``, which a fault-free reference keeps)."""

    kind = CORRUPT_PART
    failure_class = "data"
    target = "part"
    replans = False
    changes_math = True

    def validate(self, fault: FaultConfig, c: Checker) -> None:
        super().validate(fault, c)
        rule = f"{CORRUPT_PART} needs a step trigger (every loader applies it at that step)"
        c.check(fault.at_step is not None, "at_step", rule, fault.at_s)

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        return []  # the loaders apply it (see the class doc); the record marks the step

    def started_at(self, fault: Record, metrics: list[Record]) -> float:
        """When its step started: when the step before it committed."""
        at = fault.get("at_step")
        if at is None:
            return float(fault["t"])
        before = [m["t"] for m in metrics if m["step"] < at]
        return max(before) if before else min((m["t"] for m in metrics), default=float(fault["t"]))

    def detected(self, e: Record, fault: Record, region_workers: set[str]) -> bool:
        """The part was repaired, quarantined as corrupt, or the run stopped on it."""
        part = int(fault["target"])
        if e["event"] == ev.PART_REPAIRED:
            return bool(e.get("part") == part)
        if e["event"] == ev.DECISION:
            return e.get("kind") == "corrupt" and part in ev.decision_parts(e)
        return bool(e["event"] == ev.RUN_FAILED)

    def absorbed(self, fault: Record, events: list[Record], detect: Record | None) -> bool:
        return run_ended(events) and detect is not None and detect["event"] != ev.RUN_FAILED
