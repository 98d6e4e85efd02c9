"""The policies a run can be simulated under, each ``policy(context, state, event)``.

- ``perdure``: detection by socket close or phi accrual, re-plan, redo or salvage of the
  in-flight step, spares, joins at a boundary, region failover to the standby;
- ``torchrun``: every process restarts from the last checkpoint (TorchElastic);
- ``torchft``: per-step quorum; the failed replica group restarts and heals while the
  others go on at a reduced batch;
- ``diloco``: DiLoCo across regions: perdure inside each region, an outer step every H
  inner steps; a lost region's virtual replicas move to the survivors, which recompute
  their inner steps since the last outer step.
"""

from __future__ import annotations

from perdure.sim.engine import Handler
from perdure.sim.policies import diloco, perdure, torchft, torchrun

POLICIES: dict[str, Handler] = {
    "perdure": perdure.policy,
    "torchrun": torchrun.policy,
    "torchft": torchft.policy,
    "diloco": diloco.policy,
}

__all__ = ["POLICIES"]
