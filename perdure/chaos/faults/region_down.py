"""``region_down``: a whole failure domain loses power, its coordinator included."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from perdure.chaos.faults.base import Fault

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl


class RegionDown(Fault):
    """SIGKILL every process of a region at once, the coordinator too if it lives there;
    no replacement starts there until ``duration_s`` has passed (for ever if unset)."""

    kind = "region_down"
    failure_class = "partial_cluster_loss"
    target = "region"
    timed = True
    copies_state = True

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        names = control.processes(fault.target)
        pids = [p for n in names for p in control.signal(n, signal.SIGKILL, expected_exit=True)]
        control.veto_replacements(fault.target)
        return pids

    def undo(self, fault: FaultConfig, control: ClusterControl) -> bool:
        control.lift_veto(fault.target)
        return True
