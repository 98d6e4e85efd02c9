"""``poison_part``: one data part starts yielding NaN."""

from __future__ import annotations

from typing import TYPE_CHECKING

from perdure import events as ev
from perdure.chaos.faults.base import Fault, Record

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl
    from perdure.config import Checker


POISON_PART = "poison_part"
"""The kind's name, for the code that applies it (the worker's loaders, preflight)."""


class PoisonPart(Fault):
    """The samples of one part yield NaN from ``at_step`` on, applied by every loader at
    exactly that step (so a reference run poisons the same samples); the part is
    quarantined, a decision-log entry."""

    kind = POISON_PART
    failure_class = "data"
    target = "part"
    replans = False
    changes_math = True

    def validate(self, fault: FaultConfig, c: Checker) -> None:
        super().validate(fault, c)
        rule = (
            f"{POISON_PART} needs a step trigger (the reference run must poison the same samples)"
        )
        c.check(fault.at_step is not None, "at_step", rule, fault.at_s)

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        return []  # the loaders apply it (see the class doc); the record marks the step

    def started_at(self, fault: Record, metrics: list[Record]) -> float:
        """When its step started (the loaders may apply it before the launcher notices
        that step): when the step before it committed."""
        at = fault.get("at_step")
        if at is None:
            return float(fault["t"])
        before = [m["t"] for m in metrics if m["step"] < at]
        return max(before) if before else min((m["t"] for m in metrics), default=float(fault["t"]))

    def detected(self, e: Record, fault: Record, region_workers: set[str]) -> bool:
        return e["event"] == ev.DECISION and int(fault["target"]) in ev.decision_parts(e)
