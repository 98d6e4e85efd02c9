"""What a fault kind is. Each kind is one class, in its own module of this package.

A kind carries everything the rest of perdure needs to know about it, so that adding one
is one new module (and its test): its name and failure class (the fault report, the HTML
report and the config reference read them from here), the form of its target and its own
config rules (``FaultConfig`` asks it), what the launcher-side driver does to inject and
undo it (through the narrow :class:`perdure.chaos.control.ClusterControl`, never a
launcher's internals), and how its detection shows in the event log (the fault report
asks it). Nothing here imports torch: the report reads these classes on machines without
it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from perdure import events as ev

if TYPE_CHECKING:
    from perdure.chaos.config import FaultConfig
    from perdure.chaos.control import ClusterControl
    from perdure.config import Checker

FailureClass = Literal["hardware", "network", "partial_cluster_loss", "data", "planned"]
"""The design's four failure classes, plus ``planned`` for a departure that is no fault
of the cluster's (a graceful stop)."""

Target = Literal["worker", "region", "worker_or_region", "part"]
"""What a kind's ``target`` names."""

Record = dict[str, Any]

_SHAPES: dict[str, tuple[Callable[[str], bool], str]] = {
    "worker": (lambda t: "-" in t, "must be a worker name REGION-INDEX"),
    "part": (str.isdigit, "must be a dataset part index"),
}
"""Target rules that need no cluster: the form of the name."""

_LOST = frozenset({ev.LEAVE, ev.COLLECTIVE_FAILED, ev.LEAVE_REQUESTED, ev.MEMBER_BENCHED})
"""Events that say a member was lost, asked to go, or was taken out of the collective."""


class Fault:
    """One fault kind. Subclasses set the class attributes and override what differs;
    the defaults describe a fault that removes members (seen as a lost member or a
    coordinator takeover, absorbed once seen and the run ends)."""

    kind: ClassVar[str]
    """The name used in ``chaos.faults[].kind``."""
    failure_class: ClassVar[FailureClass]
    target: ClassVar[Target]
    in_process: ClassVar[bool] = False
    """Acts inside the worker: posted in the store and applied by ``runtime/member/wchaos.py``,
    which polls only when a schedule holds such a kind."""
    timed: ClassVar[bool] = False
    """``duration_s`` ends it: the driver calls :meth:`undo` that long after the injection."""
    replans: ClassVar[bool] = True
    """Absorbing it starts a new membership epoch (the report times the re-plan)."""
    copies_state: ClassVar[bool] = False
    """Absorbing it copies state to a joiner (the report times the copy)."""
    changes_math: ClassVar[bool] = False
    """It changes the math through the decision log, so a fault-free reference keeps it."""

    # -- config ----------------------------------------------------------------------------

    def validate(self, fault: FaultConfig, c: Checker) -> None:
        """This kind's own rules for one fault, added to ``c`` (field, rule, value)."""
        shape = _SHAPES.get(self.target)
        if shape is not None:
            c.check(shape[0](fault.target), "target", shape[1], fault.target)

    def check_target(self, target: str, workers: set[str], regions: set[str]) -> str | None:
        """The rule ``target`` breaks in a cluster of these workers and regions, if any."""
        if self.target == "worker" and target not in workers:
            return "no such worker"
        if self.target == "region" and target not in regions:
            return "no such region"
        if self.target == "worker_or_region" and target not in workers | regions:
            return "no such worker or region"
        return None

    # -- the launcher side -----------------------------------------------------------------

    def inject(self, fault: FaultConfig, control: ClusterControl) -> list[int]:
        """Strike now; return the process ids signalled (for the ``fault_injected`` record)."""
        raise NotImplementedError(f"fault kind {self.kind!r} cannot be injected")

    def undo(self, fault: FaultConfig, control: ClusterControl) -> bool:
        """End a timed fault; ``False``: not possible yet, the driver asks again shortly."""
        return True

    # -- reading the event log -------------------------------------------------------------

    def started_at(self, fault: Record, metrics: list[Record]) -> float:
        """When the fault took effect (default: when the launcher injected it)."""
        return float(fault["t"])

    def detected(self, e: Record, fault: Record, region_workers: set[str]) -> bool:
        """Whether event ``e`` is the system noticing ``fault``."""
        return lost_member(e, {fault["target"]} | region_workers)

    def absorbed(self, fault: Record, events: list[Record], detect: Record | None) -> bool:
        """The run went on to its end with the fault handled as its class requires."""
        return run_ended(events) and detect is not None


def lost_member(e: Record, hit: set[str] | None) -> bool:
    """A member of ``hit`` (any member, for ``None``) was lost, or a standby took over."""
    if e["event"] in _LOST:
        return hit is None or e.get("worker") in hit
    return bool(e["event"] == ev.COORDINATOR_TAKEOVER)


def run_ended(events: list[Record]) -> bool:
    return any(e["event"] == ev.RUN_END for e in events)
