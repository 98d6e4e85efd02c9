"""The coordinator policy's state, shared by its concerns: the settings, each admitted
worker's soft view, the running and the announced epoch, and the outbox of effects.

Soft state only: everything here (who is alive, each worker's next step, whether it holds
state) comes from the workers' hellos, heartbeats and ready reports, so a fresh policy (a
standby's) rebuilds its view from them. The concerns (``admission.py``, ``membership.py``,
``replan.py``, ``epochs.py``, ``leadership.py``) read and change a :class:`Board`; the
policy (``policy.py``) hands one event at a time to them and returns the outbox.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from perdure import events as ev
from perdure.run_config import RunConfig
from perdure.runtime.config import ClusterConfig
from perdure.runtime.control import protocol as p
from perdure.runtime.control.detector import PhiAccrual
from perdure.runtime.control.events import CheckpointFound, Effect, EndLease, Finish, Log, Send
from perdure.runtime.control.lag import LinkLag
from perdure.runtime.plan import Plan
from perdure.runtime.shard_plan import ALL


@dataclass
class Member:
    """The policy's soft view of one admitted worker."""

    name: str
    region: str
    role: str
    detector: PhiAccrual
    pid: int = 0
    next_step: int = 0
    has_state: bool = False
    slot_s: float | None = None
    alive: bool = True
    done: bool = False
    prepared: bool = False
    """Its trainer is built: it can enter an epoch without making the members wait."""
    address: str = ""
    """Where its data plane listens (its hello's address)."""
    lag: LinkLag = field(default_factory=LinkLag)
    """Its link's latency over its floor, from its heartbeats' stamps."""
    calm_since: float | None = None
    """Benched: since when its link has been back to speed."""
    shard: int = ALL
    """The optimizer shard it holds (``train.shard_degree`` > 1): its rank's in the last
    epoch it started, or what its last ready report said."""


@dataclass
class Pending:
    """An announced membership epoch waiting for its members' ready reports."""

    epoch: int
    members: list[str]
    after: int
    reason: str
    plan_counts: list[int] | None
    announced: float
    ready: dict[str, p.Ready] = field(default_factory=dict)
    checkpoint: CheckpointFound | None = None
    asked: bool = False


@dataclass(frozen=True)
class Settings:
    """What the policy needs from the run's config and the server."""

    config: RunConfig
    run_dir: str
    resume: str | None
    store_port: int
    instance: str
    """This coordinator's random id: store prefixes of its epochs never collide with
    another coordinator's."""
    expected: int
    standby: bool = False
    allow_config_change: bool = False
    """Workers may resume from a checkpoint of another config hash (they record it)."""
    generation: int = 1
    """The generation a primary's lease was granted under before it started serving; a
    standby starts with none (0) and gets one only by taking over."""


@dataclass
class Board:
    """What more than one concern reads or changes, and the effects of the current event."""

    s: Settings
    now: float
    workers: dict[str, Member] = field(default_factory=dict)
    epoch: int = -1
    """The newest epoch announced; numbers only grow, across coordinators too."""
    current: Plan | None = None
    pending: Pending | None = None
    finished: bool = False
    drain: p.Drain | None = None
    generation: int = 0
    """The lease generation this coordinator acts under (0: none, a standby)."""
    served: bool = False
    """An epoch started under this generation (before that, the lease is kept even with
    no worker connected)."""
    fail_at: float | None = None
    """When a collective failure with no death to explain it was reported."""
    start_step: int = 0
    high_water: int = 0
    """The highest next step any worker reported (heartbeats, ready reports) or an epoch
    started at: a live state behind it may be older than the newest checkpoint."""
    progress_unknown: bool = False
    """A standby that took over knows only what the workers still alive report (the lost
    members' progress died with the old coordinator): its first epoch compares their state
    with the newest checkpoint. A primary that regained its lease keeps its high water."""
    last_replan: float = 0.0
    last_admission: float = 0.0
    out: list[Effect] = field(default_factory=list)

    @property
    def cluster(self) -> ClusterConfig:
        return self.s.config.cluster

    def log(self, name: str, **fields: object) -> None:
        self.out.append(Log({"event": name, **fields}))

    def send(self, to: str, msg: p.FromCoordinator) -> None:
        self.out.append(Send(to, msg))

    def alive(self, role: str | None = None) -> list[Member]:
        return [w for w in self.workers.values() if w.alive and (role is None or w.role == role)]

    def members_now(self) -> list[str]:
        """The members of the newest epoch, pending or current, that are alive."""
        base = (
            self.pending.members if self.pending else self.current.members if self.current else ()
        )
        return [m for m in base if self.workers[m].alive]

    def stop_all(self, reason: str) -> None:
        """The run is over: stop every live worker, end the lease, let the server stop."""
        for w in self.alive():
            self.send(w.name, p.Stop(reason=reason))
        self.finished = True
        self.out += [EndLease(self.generation), Finish()]

    def give_up(self, reason: str, worker: str | None = None) -> None:
        """Stop the run as failed: an error every replica reproduces cannot be absorbed."""
        if self.finished:
            return
        self.log(ev.RUN_FAILED, worker=worker, reason=reason)
        self.stop_all(f"run failed: {reason}")
