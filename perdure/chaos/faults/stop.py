"""``stop``: a planned departure, and a new process under the same name later."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from perdure.chaos.faults.base import Fault

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl


class Stop(Fault):
    """SIGTERM a worker: it leaves at the next step boundary and exits 0 (not replaced);
    after ``duration_s`` a new process joins under its name."""

    kind = "stop"
    failure_class = "planned"
    target = "worker"
    timed = True
    copies_state = True

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        return control.signal(fault.target, signal.SIGTERM)

    def undo(self, fault: FaultConfig, control: ClusterControl) -> bool:
        """Start the new process, once the old one has left (it may still be leaving)."""
        return control.restart(fault.target)
