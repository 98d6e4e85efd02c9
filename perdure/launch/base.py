"""What a launcher is, and the narrow faces it shows to what it hosts.

A :class:`Launcher` runs one training run and returns its summary; the local launcher
(``launch/local.py``) is the first, and a cluster manager's (Slurm, Kubernetes, Ray) would
be another. Behaviour that is not the launcher's own job (fault injection, the live view)
composes with any launcher as a :class:`MonitorHook`, called on every tick of its monitor
loop and built against one of the small protocols below rather than a launcher class, so
that chaos works on a launcher it has never seen and a launcher needs no chaos code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from perdure.chaos.control import ClusterControl, Progress


class Launcher(Protocol):
    """Runs one training run to its end."""

    def run(self) -> dict[str, Any]:
        """Start everything, wait for the run to complete, stop everything; the summary
        (``launch/summary.py``)."""
        ...


class MonitorHook(Protocol):
    """Called by a launcher's monitor loop after it has looked after its processes."""

    def tick(self) -> None: ...


@dataclass(frozen=True)
class WorkerState:
    name: str
    region: str
    alive: bool


class Roster(Protocol):
    """What the live view shows of a launcher: its regions and its workers."""

    def regions(self) -> list[str]: ...

    def workers(self) -> list[WorkerState]: ...


__all__ = ["ClusterControl", "Launcher", "MonitorHook", "Progress", "Roster", "WorkerState"]
