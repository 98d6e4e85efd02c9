"""What a member knows of the membership epoch it runs."""

from __future__ import annotations

from dataclasses import dataclass

from perdure.checkpoint import AsyncCheckpointer
from perdure.runtime.comm.group import Comm
from perdure.runtime.control import protocol as p
from perdure.runtime.member.copy_overlap import CopyServer
from perdure.runtime.member.copy_pacing import Pacing
from perdure.runtime.plan import Plan
from perdure.runtime.step import StepRunner


@dataclass
class Epoch:
    """One membership epoch as this member runs it: its plan and rank, the coordinator's
    start, the epoch's process group and step runner, and the checkpoint writer opened
    once the member holds state."""

    number: int
    plan: Plan
    rank: int
    start: p.Start
    comm: Comm
    runner: StepRunner
    ckpt: AsyncCheckpointer | None = None
    copy: CopyServer | None = None
    """A holder's overlapped state copy, served behind the first step (``copy_overlap``)."""
    pacing: Pacing | None = None
    """The epoch's paced state copy, if any (``copy_pacing``)."""

    @property
    def generation(self) -> int:
        return self.start.generation

    @property
    def size(self) -> int:
        return len(self.plan.members)
