"""Declarative fault schedules: what to break, where and when."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from perdure.config import Checker

FaultKind = Literal["kill", "stop", "hang", "comm_error", "delay", "region_down", "poison_shard"]
WORKER_KINDS = ("kill", "stop", "hang", "comm_error")
REGION_KINDS = ("region_down",)


@dataclass(kw_only=True, frozen=True)
class FaultConfig:
    """One fault. Exactly one trigger (``at_step`` or ``at_s``) is set."""

    kind: FaultKind
    """``kill`` (SIGKILL a worker); ``stop`` (SIGTERM: a graceful leave at the next step
    boundary, and a new process takes the name after ``duration_s``); ``hang`` (SIGSTOP,
    then SIGCONT after ``duration_s``); ``comm_error`` (the worker's next collective fails);
    ``delay`` (extra latency on a worker's or region's communication and heartbeats);
    ``region_down`` (every worker of a region killed at once, the coordinator too if it
    lives there); ``poison_shard`` (a shard's samples yield NaN, injected at the loader)."""
    target: str
    """A worker name (``REGION-INDEX``, e.g. ``eu-1``) for kill, stop, hang, comm_error; a worker
    or region name for delay; a region name for region_down; a shard index for
    poison_shard."""
    at_step: int | None = None
    """Inject when the run reaches this step."""
    at_s: float | None = None
    """Inject this many seconds after the run starts."""
    duration_s: float | None = None
    """How long the fault lasts: hang (then SIGCONT), stop (then a new worker joins),
    delay, region_down (then the region's workers come back). Unset: for ever."""
    delay_ms: int = 0
    """Extra latency per collective and heartbeat, for ``delay``."""

    def __post_init__(self) -> None:
        c = Checker()
        triggers = (self.at_step is not None) + (self.at_s is not None)
        c.check(triggers == 1, "at_step", "exactly one of at_step, at_s must be set", self.at_step)
        if self.at_step is not None:
            c.non_negative("at_step", self.at_step)
        if self.at_s is not None:
            c.non_negative("at_s", self.at_s)
        if self.duration_s is not None:
            c.positive("duration_s", self.duration_s)
        if self.kind == "delay":
            c.positive("delay_ms", self.delay_ms)
        if self.kind == "poison_shard":
            c.check(self.target.isdigit(), "target", "must be a shard index", self.target)
            c.check(
                self.at_step is not None,
                "at_step",
                "poison_shard needs a step trigger "
                "(the reference run must poison the same samples)",
                self.at_s,
            )
        if self.kind in WORKER_KINDS:
            c.check("-" in self.target, "target", "must be a worker name REGION-INDEX", self.target)
        c.done()


@dataclass(kw_only=True, frozen=True)
class ChaosConfig:
    """A fault schedule; empty by default."""

    faults: list[FaultConfig] = field(default_factory=list)
    """The faults, in any order; each fires once."""
