"""Fault injection as a launcher hook: the schedule, applied through a ClusterControl.

Faults that a real cluster inflicts from outside are real here too (``kill`` is SIGKILL,
``hang`` SIGSTOP, ``region_down`` kills every process of the region, its coordinator
included); faults that need the process's cooperation (``delay``, ``comm_error``) are
posted in the store for the worker; ``poison_part`` is applied by the loaders themselves
at its step. What each kind does is its class's business (``chaos/faults/``); the driver
only decides *when*: a fault fires once its trigger is reached, and a timed one is undone
``duration_s`` later. It composes with any launcher that offers a ClusterControl.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from perdure import events as ev
from perdure.chaos import faults
from perdure.chaos.config import ChaosConfig, FaultConfig
from perdure.chaos.control import ClusterControl, Progress

RETRY_S = 0.2
"""How soon an undo that was not possible yet (a stopped worker still leaving) is retried."""


@dataclass
class _Undo:
    due: float
    index: int
    fault: FaultConfig


class ChaosDriver:
    """A monitor hook that injects each fault of ``schedule`` when its trigger is reached."""

    def __init__(
        self,
        schedule: ChaosConfig,
        control: ClusterControl,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.control = control
        self.clock = clock  # wall time: records are stamped with it
        self.todo = list(enumerate(schedule.faults))
        self.undos: list[_Undo] = []

    def tick(self) -> None:
        progress = self.control.progress()
        now = self.clock()
        due = [(i, f) for i, f in self.todo if _due(f, progress, now)]
        self.todo = [x for x in self.todo if x not in due]
        for i, fault in due:
            self._inject(i, fault, progress.step)
        ready = [u for u in self.undos if u.due <= now]
        self.undos = [u for u in self.undos if u.due > now]
        for undo in ready:
            self._undo(undo)

    @property
    def done(self) -> bool:
        """Every fault injected and every timed one undone."""
        return not self.todo and not self.undos

    def _inject(self, index: int, fault: FaultConfig, step: int) -> None:
        # stamped before the signal: the coordinator may log the victim's leave before this
        # record is written, and the fault report looks for detection after the fault
        record = {
            "t": round(self.clock(), 6),
            "event": ev.FAULT_INJECTED,
            "fault": index,
            "kind": fault.kind,
            "target": fault.target,
            "step": step,
            "at_step": fault.at_step,
        }
        kind = _kind(fault)
        pids = kind.inject(fault, self.control)
        self.control.log({**record, "pids": pids})
        if kind.timed and fault.duration_s:
            self.undos.append(_Undo(self.clock() + fault.duration_s, index, fault))

    def _undo(self, undo: _Undo) -> None:
        if not _kind(undo.fault).undo(undo.fault, self.control):
            self.undos.append(_Undo(self.clock() + RETRY_S, undo.index, undo.fault))
            return
        f = undo.fault
        self.control.log(
            {"event": ev.FAULT_ENDED, "fault": undo.index, "kind": f.kind, "target": f.target}
        )


def _kind(fault: FaultConfig) -> faults.Fault:
    kind = faults.get(fault.kind)
    assert kind is not None, fault.kind  # FaultConfig accepts registered kinds only
    return kind


def _due(fault: FaultConfig, progress: Progress, now: float) -> bool:
    if fault.at_step is not None:
        return progress.step >= fault.at_step
    assert fault.at_s is not None
    return progress.first_step_t is not None and now - progress.first_step_t >= fault.at_s


__all__ = ["RETRY_S", "ChaosDriver"]
