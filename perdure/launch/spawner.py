"""What a launcher does its own way: where its processes start and how they stop.

Every launcher shares one run loop (``launch/supervisor.py``: the monitor, the crash
rules, replacements, the stop, and the ``ClusterControl`` and ``Roster`` faces its hooks
use) and plugs in a :class:`Spawner` for the rest: the local launcher starts processes on
this machine (``launch/local.py``), the Ray launcher through one actor per process
(``launch/ray.py``). A spawner is a part of its launcher, not a subclass of another one,
so a change to how one launcher starts a process cannot change another's.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from perdure.launch.procs import Process
from perdure.run_config import RunConfig
from perdure.runtime.config import ClusterConfig


@dataclass
class Proc:
    """A process the launcher started."""

    name: str
    region: str
    kind: str  # "worker", "spare", "coordinator"
    popen: Process
    started: float = field(default_factory=time.time)
    generation: int = 0
    expected_exit: bool = False
    reaped: bool = False

    @property
    def alive(self) -> bool:
        return self.popen.poll() is None


@dataclass(frozen=True)
class RunContext:
    """What every spawner needs to know of the run it starts processes for."""

    config: RunConfig
    run_dir: Path
    token: str
    resume: str | None
    allow_config_change: bool
    events: Any
    """The launcher's part of the event log (``runlog.part``): ``write(record)``."""

    def log_of(self, name: str) -> Path:
        return self.run_dir / "logs" / f"{name}.log"


@dataclass(frozen=True)
class Started:
    """A coordinator a spawner started, once its ports file appeared."""

    proc: Proc
    channel: str
    """``HOST:PORT`` of its control channel (what workers dial)."""
    store: tuple[str, int]
    """Its store's host and port."""


class Spawner(Protocol):
    """Starts and stops a launcher's processes where they run."""

    def start_coordinators(self, ctx: RunContext) -> Iterator[Started]:
        """The coordinator (and the standby, when the config names one; see
        :func:`coordinator_names`), each yielded once it listens (so the launcher holds
        it, and stops it, before the next one starts)."""
        ...

    def prepare_workers(self, ctx: RunContext) -> None:
        """Before the first worker starts (the local launcher's fork server)."""
        ...

    def start_worker(
        self, ctx: RunContext, name: str, region: str, role: str, gen: int, coordinators: list[str]
    ) -> Process:
        """Worker ``name``'s process (generation ``gen``: 0 first, then replacements),
        told the coordinators' channels."""
        ...

    def tick(self, ctx: RunContext) -> None:
        """Called on every monitor tick, before the hooks."""
        ...

    def exit_cause(self, p: Proc) -> str | None:
        """What the platform says killed ``p`` (added to its ``process_exit`` event)."""
        ...

    def before_stop(self, ctx: RunContext, procs: list[Proc]) -> None:
        """Before the launcher signals every process to stop."""
        ...

    def close(self) -> None:
        """After every process stopped (or the stop failed): release what remains."""
        ...


def coordinator_names(cluster: ClusterConfig) -> list[tuple[str, str]]:
    """The coordinators a run starts, with their regions: the primary, and a standby
    where ``cluster.standby_region`` names one."""
    names = [("coordinator", cluster.coordinator_region or cluster.regions[0].name)]
    if cluster.standby_region:
        names.append(("standby", cluster.standby_region))
    return names


def preload_modules(config: RunConfig) -> list[str]:
    """The modules a fork server imports before forking: the task's, unless
    ``cluster.preload_task`` is off."""
    task_module = config.task.entry.partition(":")[0]
    return [task_module] if config.cluster.preload_task else []


__all__ = ["Proc", "RunContext", "Spawner", "Started", "coordinator_names", "preload_modules"]
