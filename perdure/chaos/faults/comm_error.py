"""``comm_error``: a dropped link under one worker's next collective."""

from __future__ import annotations

from typing import TYPE_CHECKING

from perdure.chaos import message
from perdure.chaos.faults.base import Fault, Record, lost_member

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl


class CommError(Fault):
    """The worker's next collective fails, as a dropped link would (posted in the store,
    applied by the worker): the same members re-form in a new membership epoch."""

    kind = "comm_error"
    failure_class = "hardware"
    target = "worker"
    in_process = True

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        message.post(control, fault.target, self.kind)
        return []

    def detected(self, e: Record, fault: Record, region_workers: set[str]) -> bool:
        """Any member's failed collective: the link has two ends, either may see it."""
        return lost_member(e, None)
