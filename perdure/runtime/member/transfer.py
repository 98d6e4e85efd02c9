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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from perdure import events as ev
from perdure.checkpoint.tensors import flatten
from perdure.events import JsonLines
from perdure.runtime.comm.swarm import CopyJob, StateCopy, StateCopyFailed
from perdure.runtime.member.copy_overlap import (
    CopyServer,
    committed_offer,
    is_overlapped,
)
from perdure.runtime.member.copy_pacing import PACE_KEY, Pacing, auto_budget, param_units
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
    copy_pace: str = "whole"
    """``cluster.copy_pace``: ``auto``, ``fixed`` or ``whole``."""
    copy_step_bytes: int = 64_000_000
    """``cluster.copy_step_mb`` in bytes: a fixed part's, an automatic first part's."""
    steps: int = 1 << 62
    """``train.steps``: a paced copy's last part lands before the run's last step (the
    config's, the same on every member; a drain that ends the run earlier flushes it)."""
    slot_s: Callable[[], float | None] = lambda: None
    """This member's measured seconds a slot (an automatic part fills its compute)."""

    def copy(self, ep: Epoch, tr: Trainer) -> bool:
        """The epoch's copy, or a paced copy's first part (``copy_pacing.py``): True
        once this member received a replica's whole state."""
        receivers = ep.start.receivers
        if not receivers:
            return False
        members = ep.plan.members
        receiving = self.name in receivers
        overlapped = is_overlapped(ep.runner.first and ep.runner.first[1], receivers)
        paced = self._pacing(ep, tr) if overlapped else None

        offer = None
        if not receiving:
            offer = tr.export()
            if overlapped:
                offer = committed_offer(offer, list(tr.module.parameters()))
            if paced is not None:
                offer = self._budgeted(ep, offer, tr.next_step, paced)
                if paced.whole_in_one(_sizes(offer), offer[2]):  # as the overlapped copy
                    ep.runner.first_until = ep.start.start_step + 1
        job = CopyJob(
            receivers=self._ranks(ep),
            source=members.index(ep.start.source),
            shard_degree=self.shard_degree,
            layout=tr.copy_layout(),
            offer=offer,
            target=self._target(tr, ep, paced) if receiving else None,
            timeout=self.timeout(),
            select=None if paced is None else paced.select(),
        )
        mode = "overlapped" if overlapped else "blocking"
        t0 = time.monotonic()
        # Overlapped or not, the copy runs on the epoch's own group: a holder's step
        # enters no collective before its gate (the copy served), a receiver none before
        # its copy is in, and the group's one comm thread runs every operation in order.
        # (A group of its own cost every member a second rendezvous and the receiver its
        # drop, ~0.02 s, on a kill's critical path: docs/performance.md, section 17.)
        if overlapped and not receiving:
            self._serve(ep, tr, job, mode)
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
        seconds = round(time.monotonic() - t0, 4)
        if paced is None:
            self._received(ep, got, mode, seconds, tr.next_step)
            return True
        return self._part_in(ep, tr, paced, got, seconds)

    def _target(self, tr: Trainer, ep: Epoch, paced: Pacing | None) -> Any:
        """A receiver's storage: paced, the optimizer tensors of the later parts zeros."""
        if paced is None:
            return tr.copy_target(ep.comm.device)
        return tr.copy_target(ep.comm.device, zeroed=True)

    def _ranks(self, ep: Epoch) -> tuple[int, ...]:
        return tuple(sorted(ep.plan.members.index(r) for r in ep.start.receivers))

    # -- a paced copy (``copy_pacing.py``) ----------------------------------------------

    def _pacing(self, ep: Epoch, tr: Trainer) -> Pacing | None:
        """The epoch's paced copy, where ``copy_pace`` asks for one and the copy can be
        paced (whole replicas: ``train.shard_degree`` = 1). Until its parts are in, the
        receivers have no slot and are partial (a copy whole in its first part ends that
        at the first step's gate, as the overlapped copy does)."""
        if self.copy_pace == "whole" or self.shard_degree != 1:
            return None
        groups = [g["params"] for g in tr.optimizer.param_groups]
        paced = Pacing(ep.start.start_step, param_units(tr.module, groups))
        ep.pacing = paced
        ep.runner.first_until = OPEN
        ep.runner.partial = frozenset(self._ranks(ep))
        return paced

    def _budgeted(
        self, ep: Epoch, offer: tuple[Any, Any, Any], step: int, paced: Pacing
    ) -> tuple[Any, Any, Any]:
        """A holder's offer with its budget for the part of step ``step`` (the template's
        is every member's): every group left at the run's last step; else an automatic
        one from the last part's rate and this member's compute of a step, or
        ``copy_step_bytes``."""
        model, optim, extra = offer
        budget = self.copy_step_bytes
        if step >= self.steps - 1:
            budget = ALL_LEFT
        elif self.copy_pace == "auto" and paced.last is not None:
            slot_s, slots = self.slot_s(), len(ep.runner.plan_at(step).slots_of(ep.rank))
            compute = None if slot_s is None else slot_s * slots
            budget = auto_budget(*paced.last, compute) or budget
        return model, optim, {**extra, PACE_KEY: budget}

    def pace(self, ep: Epoch, tr: Trainer, step: int) -> bool:
        """Before step ``step``: the paced copy's part it moves, if any. A holder serves it
        behind the step (its gate before the reduction waits for it); a receiver receives
        it now. True once this member received the whole state."""
        paced = ep.pacing
        if paced is None or paced.complete or step <= paced.start:
            return False
        assert step - paced.start == paced.parts, (step, paced.start, paced.parts)
        if self.name not in ep.start.receivers:
            offer = committed_offer(tr.export(), list(tr.module.parameters()))
            offer = self._budgeted(ep, offer, step, paced)
            self._serve(ep, tr, self._job(ep, tr, offer, paced.select()), "paced")
            return False
        t0 = time.monotonic()
        got = self._part(ep, tr, self._job(ep, tr, None, paced.select()))
        return self._part_in(ep, tr, paced, got, round(time.monotonic() - t0, 4))

    def flush(self, ep: Epoch, tr: Trainer, step: int) -> bool:
        """At the run's end, whose final save and hash need every member's whole state
        (a drain asked for before the last part): the groups left, all at once, blocking,
        after step ``step``. True once this member received the whole state."""
        paced = ep.pacing
        if paced is None or paced.total is None or paced.complete:
            return False
        paced.flushed = step
        receiving = self.name in ep.start.receivers
        offer = None if receiving else self._budgeted(ep, tr.export(), step, paced)
        job = self._job(ep, tr, offer, paced.select(rest=True))
        t0 = time.monotonic()
        if offer is None:
            got = self._part(ep, tr, job)
            return self._part_in(ep, tr, paced, got, round(time.monotonic() - t0, 4))
        self.state_copy.copy(ep.comm, job)
        seconds = round(time.monotonic() - t0, 4)
        self._advanced(ep, paced, step + 1, "flushed", seconds, dict(self.state_copy.stats))
        return False

    def _job(
        self,
        ep: Epoch,
        tr: Trainer,
        offer: tuple[Any, Any, Any] | None,
        select: Callable[[Sequence[tuple[str, int]], Mapping[str, object]], frozenset[str]],
    ) -> CopyJob:
        receiving = offer is None
        return CopyJob(
            receivers=self._ranks(ep),
            source=ep.plan.members.index(ep.start.source),
            shard_degree=self.shard_degree,
            layout=tr.copy_layout(),
            offer=offer,
            target=tr.part_target() if receiving else None,
            timeout=self.timeout(),
            select=select,
        )

    def _part(self, ep: Epoch, tr: Trainer, job: CopyJob) -> Any:
        """A receiver's later part, into its live tensors."""
        try:
            got = self.state_copy.copy(ep.comm, job)
        except ValueError as e:  # ``part_target``: a structure the first part did not build
            raise StateCopyFailed(str(e)) from e
        assert got is not None
        return got

    def _part_in(self, ep: Epoch, tr: Trainer, paced: Pacing, got: Any, seconds: float) -> bool:
        """A receiver's part is in: its event; the last one makes the replica whole."""
        tr.torn = False
        part = paced.parts
        paced.advance()
        tr.partial = not paced.complete
        self._window(ep, paced, tr.next_step)
        self._received(ep, got, self._mode(paced, part), seconds, tr.next_step, (part, paced))
        return paced.complete

    def _window(self, ep: Epoch, paced: Pacing, step: int) -> None:
        """After step ``step``'s part, before its reduction: a complete copy gives the
        receivers their slots from the next step on (and none is partial any more); else
        they have none in the next step either (whatever a holder's view before the copy
        predicted: it set only the next step's read-ahead)."""
        if paced.complete:
            ep.runner.first_until = step + 1
            ep.runner.partial = frozenset()
        else:
            ep.runner.first_until = OPEN

    def _mode(self, paced: Pacing, part: int) -> str:
        if paced.flushed is not None:
            return "flushed"
        return "overlapped" if part == 0 and paced.complete else "paced"

    def _serve(self, ep: Epoch, tr: Trainer, job: CopyJob, mode: str) -> None:
        """A holder's copy (or part) served behind the step: its gate before the step's
        reduction waits for it."""
        step = tr.next_step
        server = CopyServer(ep.comm, self.state_copy, job, step=step, mode=mode)
        ep.copy = server
        ep.runner.gate = _CopyGate(lambda: self._sent(ep, server, mode, step), server)

    def _received(
        self,
        ep: Epoch,
        got: Any,
        mode: str,
        seconds: float,
        next_step: int,
        part: tuple[int, Pacing] | None = None,
    ) -> None:
        members = ep.plan.members
        event = {
            "event": ev.STATE_RECEIVED,
            "worker": self.name,
            "epoch": ep.number,
            "from": members[got.template],
            "holders": [members[h] for h in got.holders],
            "bytes": got.nbytes,
            "refetched": got.refetched,
            "seconds": seconds,
            "next_step": next_step,
            "mode": mode,
            "overlapped_step": ep.start.start_step if mode != "blocking" else None,
        }
        self.events.write(event | _part_fields(mode, part))

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
        """A holder's gate: its copy (or a paced copy's part) served, before the step's
        reduction."""
        sent = dict(server.wait(self.should_stop))
        ep.copy = None
        seconds = sent.pop("seconds")
        paced = ep.pacing
        if paced is None:
            self._sent_event(ep, mode, step, seconds, sent)
            return
        self._advanced(ep, paced, step, mode, seconds, sent)

    def _advanced(
        self, ep: Epoch, paced: Pacing, step: int, mode: str, seconds: float, stats: dict
    ) -> None:
        """A holder's part is served: every member moves on alike; its rate sizes the
        next automatic part."""
        part = paced.parts
        paced.last = (paced.moving[1], seconds)
        paced.advance()
        self._window(ep, paced, step)
        if mode != "flushed":
            mode = self._mode(paced, part)
        self._sent_event(ep, mode, step, seconds, stats, (part, paced))

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
            self._sent_event(ep, server.mode, server.step, seconds, sent)

    def _sent_event(
        self,
        ep: Epoch,
        mode: str,
        step: int,
        seconds: float,
        stats: dict[str, Any],
        part: tuple[int, Pacing] | None = None,
    ) -> None:
        event = {
            "event": ev.STATE_SENT,
            "worker": self.name,
            "epoch": ep.number,
            "to": list(ep.start.receivers),
            "next_step": step,
            "bytes": stats.get("bytes_sent", 0),
            "ranges": stats.get("ranges_sent", 0),
            "seconds": seconds,
            "mode": mode,
            "overlapped_step": ep.start.start_step if mode != "blocking" else None,
        }
        self.events.write(event | _part_fields(mode, part))

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


def _sizes(offer: tuple[Any, Any, Any]) -> list[tuple[str, int]]:
    """An offer's flattened keys and their bytes, in its order (what a template shows)."""
    tensors, _ = flatten(offer[0], offer[1])
    return [(k, t.numel() * t.element_size()) for k, t in tensors.items()]


OPEN = 1 << 62
"""``StepRunner.first_until`` while a paced copy's parts are on their way."""

ALL_LEFT = 1 << 62
"""A part's budget that takes every group left."""


def _part_fields(mode: str, part: tuple[int, Pacing] | None) -> dict[str, Any]:
    """A paced copy's part in its events: its index, whether it completed the copy."""
    if part is None or mode == "overlapped":
        return {}
    index, paced = part
    return {"part": index, "complete": paced.complete}


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
