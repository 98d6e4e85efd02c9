"""A member's heartbeats to its coordinator, and its watch on the run directory's fence.

A thread from admission on (building the trainer can take seconds on a busy machine): each
beat carries the member's progress and its recent slot time (the coordinator's lag and
re-plan inputs); between beats it applies the faults posted for it in the store
(``wchaos.py``) and reads the fence, so that a worker waiting on a coordinator that stopped
(hung, cut off without its connection closing) learns of the takeover here, not only at
its next step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from perdure.events import JsonLines
from perdure.runtime.control import protocol as p
from perdure.runtime.control.client import MembershipClient
from perdure.runtime.control.fence import Fence
from perdure.runtime.member.wchaos import ChaosState, DelayedLink
from perdure.runtime.replica.trainer import Trainer

log = logging.getLogger("perdure.worker")


@dataclass(kw_only=True)
class Heartbeat:
    """What the beat loop reads of its worker; ``run`` is the thread's body."""

    client: MembershipClient
    chaos: ChaosState
    fence: Fence
    events: JsonLines
    name: str
    region: str
    interval_s: float
    store: Callable[[float], dist.Store]
    """A connection to the run's store, for the posted faults (opened when first needed)."""
    trainer: Callable[[], Trainer | None]
    slot_s: Callable[[], float | None]
    fenced: Callable[[int, str], None]
    """Called with the newer generation and why, once the fence moved past ours."""

    def run(self) -> None:
        store: dist.Store | None = None
        watched = self.chaos.watches(self.name, self.region)
        link = DelayedLink(self.client.send)  # the slow_heartbeat fault's delay line
        while not self.client.stopped:
            time.sleep(self.interval_s)
            try:
                if watched:
                    store = store or self.store(5.0)
                    self.chaos.poll(store, self.name, self.region, self.events)
            except (RuntimeError, dist.DistError):
                store = None
            self.chaos.tick()
            self.poll_fence()
            t = self.trainer()
            beat = p.Heartbeat(
                next_step=t.next_step if t else 0,
                slot_s=self.slot_s(),
                prepared=t is not None,
                sent=time.time(),
            )
            link.send(beat, self.chaos.delay_s(), time.monotonic())

    def poll_fence(self) -> None:
        """Leave for a newer coordinator once the fence says one took over."""
        try:
            newer = self.fence.current()
        except (OSError, ValueError) as e:
            log.warning("%s: cannot read the fence: %s", self.name, e)
            return
        if newer > self.client.generation:
            self.fenced(newer, f"the run directory's fence is at generation {newer}")
