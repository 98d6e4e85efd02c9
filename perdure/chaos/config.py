"""Declarative fault schedules: what to break, where and when.

The kinds are not listed here: each is a class in ``chaos/faults/`` (the registry), which
holds its own rules; ``FaultConfig`` checks what every fault shares (one trigger, ranges)
and asks the kind for the rest, so that the config never drifts from the kinds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from perdure.chaos import faults as registry
from perdure.config import Checker, renamed, renamed_value


@dataclass(kw_only=True, frozen=True)
class FaultConfig:
    """One fault. Exactly one trigger (``at_step`` or ``at_s``) is set."""

    kind: str = field(metadata=renamed(registry.RENAMED))
    """What breaks: one of the kinds of the fault registry (``perdure/chaos/faults/``, one
    module each); the table *Fault kinds* below says what each does, its failure class
    and what its target names. The old names ``poison_shard`` and ``corrupt_shard`` are
    read as ``poison_part`` and ``corrupt_part``, with a DeprecationWarning."""
    target: str
    """What the fault strikes, in the form its kind names (table below): a worker name
    (``REGION-INDEX``, e.g. ``eu-1``), a region name, either of the two, or a dataset
    part's index."""
    at_step: int | None = None
    """Inject once step ``at_step`` has committed (the launcher's chaos driver reads it in
    metrics.jsonl every tick): the fault hits step ``at_step + 1`` or, when the run got
    ahead of the poll, a later one. The ``fault_injected`` record's ``step`` (the report's
    injected step) is the highest committed step at that moment: ``at_step``, or more by
    the poll's lag. Worker-side kinds applied by every loader (``poison_part``) hit
    exactly ``at_step``."""
    at_s: float | None = None
    """Inject this many seconds after the run starts."""
    duration_s: float | None = None
    """How long the fault lasts, for the timed kinds (table below): hang (then SIGCONT),
    stop (then a new worker joins), delay, region_down (then the region's workers come
    back). Unset: for ever."""
    delay_ms: int = 0
    """Extra latency per collective and heartbeat, for ``delay``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", renamed_value(self.kind, registry.RENAMED, "kind"))
        c = Checker()
        self._check_shared(c)
        kind = registry.get(self.kind)
        if kind is None:
            c.one_of("kind", self.kind, registry.kinds())
        else:
            kind.validate(self, c)
        c.done()

    def _check_shared(self, c: Checker) -> None:
        triggers = (self.at_step is not None) + (self.at_s is not None)
        c.check(triggers == 1, "at_step", "exactly one of at_step, at_s must be set", self.at_step)
        if self.at_step is not None:
            c.non_negative("at_step", self.at_step)
        if self.at_s is not None:
            c.non_negative("at_s", self.at_s)
        if self.duration_s is not None:
            c.positive("duration_s", self.duration_s)


@dataclass(kw_only=True, frozen=True)
class ChaosConfig:
    """A fault schedule; empty by default."""

    faults: list[FaultConfig] = field(default_factory=list)
    """The faults, in any order; each fires once."""

    @property
    def in_process(self) -> list[FaultConfig]:
        """The faults a worker applies itself (it polls the store only for these)."""
        return [f for f in self.faults if f.kind in registry.in_process_kinds()]


def check_targets(chaos: ChaosConfig, workers: set[str], regions: set[str], c: Checker) -> None:
    """Each fault's target must exist in the cluster (``RunConfig`` knows the cluster)."""
    for i, f in enumerate(chaos.faults):
        kind = registry.get(f.kind)
        rule = kind.check_target(f.target, workers, regions) if kind else None
        c.check(rule is None, f"chaos.faults[{i}].target", rule or "", f.target)
