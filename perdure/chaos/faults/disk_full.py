"""``disk_full``: the file system of the checkpoints fills up."""

from __future__ import annotations

from typing import TYPE_CHECKING

from perdure import events as ev
from perdure.chaos import message
from perdure.chaos.faults.base import Fault, Record, run_ended

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl


class DiskFull(Fault):
    """A worker (or each worker of a region) fills the file system of its checkpoint
    directory (``checkpoint.dir``, default the run's) with one file for ``duration_s``
    (unset: until it exits), then deletes it (posted in the store, applied by the
    worker). Saves fail with "No space left on device" meanwhile (``checkpoint_failed``),
    their partial files are removed, and training goes on; the next due save after the
    disk has room commits. Meant for a checkpoint directory on a file system of its own
    (a tmpfs, a volume): the whole file system is filled, whoever else uses it."""

    kind = "disk_full"
    failure_class = "hardware"
    target = "worker_or_region"
    in_process = True
    timed = True
    replans = False

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        message.post(control, fault.target, self.kind, duration_s=fault.duration_s)
        return []

    def detected(self, e: Record, fault: Record, region_workers: set[str]) -> bool:
        """A save failed for want of space."""
        return e["event"] == ev.CHECKPOINT_FAILED and "No space left" in str(e.get("error", ""))

    def absorbed(self, fault: Record, events: list[Record], detect: Record | None) -> bool:
        return run_ended(events) and detect is not None
