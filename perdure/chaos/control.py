"""What fault injection needs from a launcher, and nothing more.

Owned by chaos, the consumer: a launcher implements :class:`ClusterControl` (the local
launcher does; ``launch/base.py`` re-exports it beside the ``Launcher`` protocol), and no
module of ``perdure.chaos`` imports a launcher.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


@dataclass(frozen=True)
class Progress:
    """How far the run is, from its committed steps."""

    step: int = -1
    """The highest committed step; -1 before the first."""
    first_step_t: float | None = None
    """Wall time of the first committed step (time triggers count from it)."""


class ClusterControl(Protocol):
    """What fault injection needs from a launcher, and nothing more. Processes are named:
    workers by their worker name, coordinators ``coordinator`` and ``standby``."""

    def signal(self, name: str, sig: int, *, expected_exit: bool = False) -> list[int]:
        """Send ``sig`` to the live process called ``name``; the pids signalled (none if it
        is not alive). ``expected_exit``: its death is the fault's doing, not a crash."""
        ...

    def processes(self, region: str) -> list[str]:
        """The live processes of ``region``, workers and coordinators."""
        ...

    def post(self, key: str, value: str) -> bool:
        """Set ``key`` in the run's store, where workers poll for in-process faults;
        whether a store took it."""
        ...

    def restart(self, name: str) -> bool:
        """Start worker ``name`` again (a new process under its name); ``False`` while
        its old process is still alive."""
        ...

    def veto_replacements(self, region: str) -> None:
        """Start no replacement in ``region`` until :meth:`lift_veto` (a region that is
        down has no machines to start them on)."""
        ...

    def lift_veto(self, region: str) -> None: ...

    def progress(self) -> Progress: ...

    def log(self, record: dict[str, Any]) -> None:
        """Append ``record`` to the run's event log."""
        ...
