"""``hang``: a worker stops answering, without dying."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from perdure.chaos.faults.base import Fault

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl


class Hang(Fault):
    """SIGSTOP a worker, SIGCONT after ``duration_s``: the failure detector declares it
    dead; on waking it finds its channel closed, reconnects and rejoins as a receiver."""

    kind = "hang"
    failure_class = "hardware"
    target = "worker"
    timed = True
    copies_state = True

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        return control.signal(fault.target, signal.SIGSTOP)

    def undo(self, fault: FaultConfig, control: ClusterControl) -> bool:
        control.signal(fault.target, signal.SIGCONT)
        return True
