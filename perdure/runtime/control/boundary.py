"""When a planned epoch change starts: a rule the coordinator's policy follows and the
simulator (``perdure/sim``) calls, in a module that imports nothing heavy (no torch)."""

from __future__ import annotations

import math


def boundary_margin(step_s: float | None, heartbeat_s: float, cap: int = 20) -> int:
    """Extra steps before a planned epoch change: how many steps a heartbeat's staleness
    plus the notice's delivery (one more heartbeat interval, generously) can cover."""
    if not step_s or step_s <= 0:
        return 1
    return min(cap, math.ceil(2 * heartbeat_s / step_s))
