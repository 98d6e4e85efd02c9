"""``kill``: a worker process dies mid-step."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

from perdure.chaos.faults.base import Fault

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl


class Kill(Fault):
    """SIGKILL a worker: the survivors' collective fails and they re-form without it; a
    replacement joins and copies state."""

    kind = "kill"
    failure_class = "hardware"
    target = "worker"
    copies_state = True

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        return control.signal(fault.target, signal.SIGKILL, expected_exit=True)
