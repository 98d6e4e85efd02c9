"""The coordinator policy's inputs and outputs: typed events in, typed effects out.

Every input to the policy is one of the events here (a hello, a message from an admitted
worker, a closed connection, a timer tick, a checkpoint lookup's answer, a lease store's
answer), with the time inside it; every output is an effect that the server
(``coordinator.py``) or its lease agent (``lease_agent.py``) carries out. Types only: no
decision lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

from perdure.runtime.control import protocol as p
from perdure.runtime.control.lease import LeaseView

# -- events in -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Joined:
    """A connection answered its challenge; ``authentic``: the HMAC checked out."""

    conn: int
    hello: p.Hello
    authentic: bool
    now: float
    launched_pid: int | None = None
    """The pid the launcher started under the hello's name (``control/launched.py``), where
    one recorded it: a name's claim is settled by it (see ``admission.claim``)."""


@dataclass(frozen=True)
class Received:
    """A message from an admitted worker."""

    worker: str
    msg: p.FromWorker
    now: float
    wall: float | None = None
    """The wall clock at its arrival (heartbeat stamps are the sender's wall clock)."""


@dataclass(frozen=True)
class Closed:
    """An admitted worker's connection ended: closed, a send failed, or it broke the
    protocol."""

    worker: str
    reason: str
    now: float


@dataclass(frozen=True)
class Tick:
    """Time passed (the server ticks every few milliseconds)."""

    now: float


@dataclass(frozen=True)
class CheckpointFound:
    """The answer to :class:`FindCheckpoint`: the newest intact checkpoint, if any."""

    epoch: int
    path: str | None
    step: int
    now: float


@dataclass(frozen=True)
class DrainRequested:
    """Someone asked the run to stop early and cleanly (a signal to the coordinator)."""

    reason: str
    now: float


@dataclass(frozen=True)
class LeaseGranted:
    """The lease is ours as ``generation`` (acquired or renewed) until ``until``."""

    generation: int
    until: float
    now: float


@dataclass(frozen=True)
class LeaseObserved:
    """A read of the lease store."""

    view: LeaseView
    now: float


@dataclass(frozen=True)
class LeaseLost:
    """A renewal or an acquisition was refused: the store shows ``view``."""

    view: LeaseView
    now: float


@dataclass(frozen=True)
class LeaseUnavailable:
    """The lease store did not answer (or answered with an error)."""

    error: str
    now: float


@dataclass(frozen=True)
class PrimaryProbed:
    """The standby's probe of the primary's channel: ``serving`` when a coordinator
    answered its challenge as serving; ``detail`` says what happened."""

    serving: bool
    detail: str
    now: float


Event = (
    Joined
    | Received
    | Closed
    | Tick
    | CheckpointFound
    | DrainRequested
    | LeaseGranted
    | LeaseObserved
    | LeaseLost
    | LeaseUnavailable
    | PrimaryProbed
)

# -- effects out -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Send:
    to: str
    msg: p.FromCoordinator


@dataclass(frozen=True)
class Log:
    record: dict[str, object]


@dataclass(frozen=True)
class Accept:
    """Bind connection ``conn`` to ``worker`` and send it the welcome."""

    conn: int
    worker: str
    welcome: p.Welcome


@dataclass(frozen=True)
class Reject:
    conn: int
    reason: str
    retry: bool = False
    """Not now rather than never: the worker tries elsewhere and comes back."""


@dataclass(frozen=True)
class Disconnect:
    worker: str


@dataclass(frozen=True)
class CountRefusal:
    """A peer that did not prove the run token was refused: counted, logged once per
    interval with the others (``control/refusals.py``), never a line of its own."""

    conn: int
    reason: str


@dataclass(frozen=True)
class FindCheckpoint:
    """Every replica is lost: where does epoch ``epoch`` start from?"""

    epoch: int


@dataclass(frozen=True)
class Finish:
    """The run is complete: the server may stop."""


@dataclass(frozen=True)
class HoldLease:
    """Renew the lease of ``generation`` now and every quarter TTL."""

    generation: int


@dataclass(frozen=True)
class WatchLease:
    """Stop renewing; read the store now and every quarter TTL."""


@dataclass(frozen=True)
class AcquireLease:
    """Take the lease if the store still shows ``expect``; then hold it."""

    expect: LeaseView


@dataclass(frozen=True)
class ProbePrimary:
    """Try the primary's channel (``channel``, from its lease record, unless the server
    was told another address) and report whether a serving coordinator answers."""

    channel: str


@dataclass(frozen=True)
class EndLease:
    """The run is over under ``generation``: mark it ended in the store."""

    generation: int


LeaseEffect = HoldLease | WatchLease | AcquireLease | ProbePrimary | EndLease

Effect = (
    Send | Log | Accept | Reject | CountRefusal | Disconnect | FindCheckpoint | Finish | LeaseEffect
)
