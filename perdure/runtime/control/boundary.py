"""When a planned epoch change starts: a rule the coordinator's policy follows and the
simulator (``perdure/sim``) calls, in a module that imports nothing heavy (no torch)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from perdure.runtime.control.state import Board
    from perdure.runtime.plan import Plan


def boundary_margin(step_s: float | None, heartbeat_s: float, cap: int = 20) -> int:
    """Extra steps before a planned epoch change: how many steps a heartbeat's staleness
    plus the notice's delivery (one more heartbeat interval, generously) can cover."""
    if not step_s or step_s <= 0:
        return 1
    return min(cap, math.ceil(2 * heartbeat_s / step_s))


def step_s(
    plan: Plan | None, slot_s: Mapping[str, float | None], *, partial: bool = False
) -> float | None:
    """The slowest member's step time, from its reported per-slot time (None until every
    member reported one; with ``partial``, of the members that did, None until one did)."""
    if plan is None:
        return None
    times = []
    for r, m in enumerate(plan.members):
        s = slot_s[m]
        if s is None:
            if partial:
                continue
            return None
        times.append(s * len(plan.slots_of(r)))
    return max(times, default=None)


def boundary(next_steps: list[int], step: float | None, heartbeat_s: float) -> int:
    """The first step of a planned (not failure-driven) epoch change: far enough ahead
    that no member has started it when the notice arrives. Heartbeats report a member's
    step up to a heartbeat interval late, and a member that has begun step ``after``
    must abandon it; with steps shorter than a heartbeat, ``last + 1`` meant one
    abandoned step per join."""
    return max(next_steps, default=0) + 1 + boundary_margin(step, heartbeat_s)


def planned_boundary(b: Board) -> int:
    """The boundary of a planned change of the running epoch (a join, a rebalance, a
    graceful leave, a drain). The members that reported a slot time give the step's pace:
    one whose heartbeats are late (a delayed link) has reported none yet, and waiting for
    every member's, or a leave at the last reported step + 1, put the boundary behind
    steps of 40 ms: the members had begun step 7 when a leave at step 5 was announced (seen
    in a clean-clone CI), and gave that step up."""
    members = b.current.members if b.current else ()
    steps = [b.workers[m].next_step for m in members]
    pace = step_s(b.current, {m: w.slot_s for m, w in b.workers.items()}, partial=True)
    return boundary(steps, pace, b.cluster.heartbeat_ms / 1000)
