"""State transfer at a membership epoch's start: a live replica's state to the members
that lack it (``comm/swarm.py``), and each member's own shard of the optimizer state
(``shard_group.py``).

The copy is blocking, at the epoch's start, or overlapped with the epoch's first step
(``copy_overlap.py``; the coordinator planned that step with no slot on a receiver,
``control/copy_rule.overlaps``). A receiver copies at once either way; an overlapping
holder leaves the copy to a server thread and passes its gate before the first step's
reduction. Every copy leaves an event: ``state_received`` on a receiver, ``state_sent``
on a holder.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from perdure import events as ev
from perdure.events import JsonLines
from perdure.runtime.comm.swarm import CopyJob, StateCopy, StateCopyFailed
from perdure.runtime.member.copy_overlap import (
    CopyServer,
    committed_offer,
    is_overlapped,
)
from perdure.runtime.member.epoch import Epoch
from perdure.runtime.member.shard_group import Shards
from perdure.runtime.replica.trainer import Trainer

SETTLE_WAIT_S = 0.5
"""Longest an epoch's close waits for a holder's overlapped copy still on its way (its
last range, its bookkeeping) before leaving it: a copy that cannot finish ends at its
abort check, which the epoch's change has set."""


@dataclass(kw_only=True)
class StateTransfer:
    """One member's side of the epoch's state copy; ``copy`` returns True when this
    member received a replica's state."""

    name: str
    events: JsonLines
    state_copy: StateCopy
    shard_degree: int
    timeout: Callable[[], timedelta]
    should_stop: Callable[[], bool]

    def copy(self, ep: Epoch, tr: Trainer) -> bool:
        receivers = ep.start.receivers
        if not receivers:
            return False
        members = ep.plan.members
        receiving = self.name in receivers
        overlapped = is_overlapped(ep.runner.first and ep.runner.first[1], receivers)

        offer = None
        if not receiving:
            offer = tr.export()
            if overlapped:
                offer = committed_offer(offer, list(tr.module.parameters()))
        job = CopyJob(
            receivers=tuple(sorted(members.index(r) for r in receivers)),
            source=members.index(ep.start.source),
            shard_degree=self.shard_degree,
            layout=tr.copy_layout(),
            offer=offer,
            target=tr.copy_target(ep.comm.device) if receiving else None,
            timeout=self.timeout(),
        )
        mode = "overlapped" if overlapped else "blocking"
        t0 = time.monotonic()
        # Overlapped or not, the copy runs on the epoch's own group: a holder's step
        # enters no collective before its gate (the copy served), a receiver none before
        # its copy is in, and the group's one comm thread runs every operation in order.
        # (A group of its own cost every member a second rendezvous and the receiver its
        # drop, ~0.02 s, on a kill's critical path: docs/performance.md, section 17.)
        if overlapped and not receiving:
            server = CopyServer(ep.comm, self.state_copy, job, step=tr.next_step)
            ep.copy, step = server, tr.next_step
            ep.runner.gate = _CopyGate(lambda: self._sent(ep, server, mode, step), server)
            return False
        got = self.state_copy.copy(ep.comm, job)
        if got is None:
            stats = dict(self.state_copy.stats)
            self._sent_event(ep, mode, tr.next_step, round(time.monotonic() - t0, 4), stats)
            return False

        try:
            tr.adopt(got.model, got.optimizer, got.extra)
        except Exception as e:  # a peer's structure that does not load: refused
            raise StateCopyFailed(f"state copy from {members[got.template]}: {e}") from e
        self.events.write(
            {
                "event": ev.STATE_RECEIVED,
                "worker": self.name,
                "epoch": ep.number,
                "from": members[got.template],
                "holders": [members[h] for h in got.holders],
                "bytes": got.nbytes,
                "refetched": got.refetched,
                "seconds": round(time.monotonic() - t0, 4),
                "next_step": tr.next_step,
                "mode": mode,
                "overlapped_step": ep.start.start_step if overlapped else None,
            }
        )
        return True

    def then(self, ep: Epoch, after: Callable[[], None]) -> None:
        """``after`` (the replica groups' shard exchange) once this member's copy is done:
        now, or, for a holder whose copy overlaps the first step, at its gate, after the
        copy is served (the exchange is on the epoch's group, where it must follow the
        copy's operations, and only the update needs it)."""
        gate, server = ep.runner.gate, ep.copy  # both set by an overlapping holder's copy
        if gate is None or server is None:
            after()
            return

        def passed() -> None:
            gate()
            after()

        ep.runner.gate = _CopyGate(passed, server)

    def _sent(self, ep: Epoch, server: CopyServer, mode: str, step: int) -> None:
        """A holder's gate: its copy served, before the first step's reduction."""
        sent = dict(server.wait(self.should_stop))
        ep.copy = None
        seconds = sent.pop("seconds")
        self._sent_event(ep, mode, step, seconds, sent)

    def settle(self, ep: Epoch) -> None:
        """An epoch that ends while its overlapped copy is out: a holder whose copy was
        served in full still leaves its ``state_sent`` event (the receiver holds what it
        sent, though the gate before the first step's reduction was never reached: the
        epoch ended in that step, a peer evicted under load, say); one still on its way
        is given ``SETTLE_WAIT_S``. A copy not served in full leaves none; the server is
        left to its abort check either way."""
        server = ep.copy
        if server is None:
            return
        ep.copy = None
        sent = server.finished(SETTLE_WAIT_S)
        server.close()
        if sent is not None:
            seconds = sent.pop("seconds")
            self._sent_event(ep, "overlapped", server.step, seconds, sent)

    def _sent_event(
        self, ep: Epoch, mode: str, step: int, seconds: float, stats: dict[str, Any]
    ) -> None:
        self.events.write(
            {
                "event": ev.STATE_SENT,
                "worker": self.name,
                "epoch": ep.number,
                "to": list(ep.start.receivers),
                "next_step": step,
                "bytes": stats.get("bytes_sent", 0),
                "ranges": stats.get("ranges_sent", 0),
                "seconds": seconds,
                "mode": mode,
                "overlapped_step": ep.start.start_step if mode == "overlapped" else None,
            }
        )

    def exchange_shards(self, ep: Epoch, tr: Trainer, shards: Shards, scatters: bool) -> None:
        """Every member holds its own shard's optimizer state before the first step."""
        t0 = time.monotonic()
        tr.keep_shard(*shards.exchange(ep.comm, tr.held, tr.whole_optimizer(), tr.filled))
        sc = shards.scatter
        self.events.write(
            {
                "event": ev.SHARD_REDUCE,
                "worker": self.name,
                "epoch": ep.number,
                "mode": "whole" if sc is None else "scatter",
                "range": None if sc is None else list(sc.mine),
                "why": shards.why_whole if scatters else None,
            }
        )
        if tr.gather is not None:
            self.events.write(
                {
                    "event": ev.PARAMS_AT_REST,
                    "worker": self.name,
                    "epoch": ep.number,
                    "shard": shards.mine,
                    "bytes": tr.gather.held,
                    "of": sum(tr.gather.nbytes),
                    "init_peak_bytes": tr.peak_param_bytes,
                    "ckpt_read_bytes": tr.ckpt_read_bytes,
                }
            )
        if shards.received is not None:
            src, nbytes = shards.received
            self.events.write(
                {
                    "event": ev.SHARD_RECEIVED,
                    "worker": self.name,
                    "epoch": ep.number,
                    "shard": shards.mine,
                    "from": ep.plan.members[src],
                    "bytes": nbytes,
                    "seconds": round(time.monotonic() - t0, 4),
                }
            )


@dataclass(frozen=True)
class _CopyGate:
    """A holder's gate before the first step's reduction (``StepRunner.gate``): its copy
    served (``passed``, which leaves the ``state_sent`` event)."""

    passed: Callable[[], None]
    server: CopyServer

    def ready(self) -> bool:
        return self.server.served()

    def __call__(self) -> None:
        self.passed()
