"""One member's steps in one membership epoch: slot buffers, the reduction, the non-finite
flags and the replica fingerprints.

The runner owns what lives as long as the epoch: the slot buffers (laid out by the
trainer's :class:`~perdure.runtime.replica.layout.GradLayout`), the reducer with its scratch space,
and the epoch's comm. It knows nothing of the control plane: the worker hands it a
``should_stop(step)`` predicate, an ``evict`` callback and the event log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Protocol, cast

import torch

from perdure import events as ev
from perdure.events import JsonLines
from perdure.runtime.comm.group import Abandoned, Comm, CommFailed
from perdure.runtime.comm.int8_gather import Int8Gather
from perdure.runtime.comm.readiness import Readiness
from perdure.runtime.comm.reducer import CarriedReduction, Reducer, make_reducer
from perdure.runtime.plan import Plan
from perdure.runtime.replica.salvage import SlotSalvage
from perdure.runtime.replica.trainer import WITHHELD, MathError, Trainer
from perdure.runtime.shard_plan import group_of


class SlotTimer:
    """Seconds per slot, smoothed: the planner's measure of a member's speed."""

    def __init__(self) -> None:
        self.slot_s: float | None = None

    def record(self, busy_s: float, slots: int) -> None:
        x = busy_s / slots
        self.slot_s = x if self.slot_s is None else 0.7 * self.slot_s + 0.3 * x


@dataclass
class Seams:
    """What a step runner needs from its worker, besides the trainer and the epoch."""

    name: str
    events: JsonLines
    timeout: Callable[[], timedelta]
    should_stop: Callable[[int], bool]
    evict: Callable[[str, str], None]
    """``evict(worker, reason)``: ask the coordinator to evict a member."""
    delay_s: Callable[[], float] = lambda: 0.0
    """Injected link latency now in force (the ``delay`` fault)."""
    take_comm_error: Callable[[], bool] = lambda: False
    """True once per injected link drop (the ``comm_error`` fault)."""
    evict_after: int = 2
    suspects: dict[str, int] = field(default_factory=dict)
    """Non-reproduced non-finite slots per worker, kept across epochs."""
    salvage: SlotSalvage = field(default_factory=SlotSalvage)
    """Finished slots of the step in flight, kept across epochs (``runtime/replica/salvage.py``)."""


@dataclass(frozen=True)
class StepEnd:
    """The worker's side of a step's end, which the step itself does not know about."""

    before_update: Callable[[], None]
    """Called before the optimizer touches the state, and before the slots are computed
    where computing them writes it too (``Trainer.computes_in_place``: DiLoCo's inner
    steps, BatchNorm's buffers): the checkpoint snapshot in flight must have copied it.
    Called twice in such a step: the second call returns at once."""
    after_update: Callable[[int, float | None, float], None]
    """``(step, loss, step_s)`` once the update is in: the commit (metrics, fingerprints,
    a due checkpoint). ``loss`` None: an overlapped outer step, whose loss arrives with its
    reduction (its metrics line is :attr:`StepRunner.settled`'s)."""


@dataclass
class OuterFlight:
    """An overlapped outer step's reduction (``outer.delay = 1``), on the comm thread
    while the next step's replicas run: the step, the future of its sum, the replicas this
    member sent (their buffers stay the flight's until it settles) and the step's time."""

    step: int
    fut: Any
    slots: list[int]
    bufs: list[torch.Tensor]
    step_s: float = 0.0


def train_step(run: StepRunner, t: int, end: StepEnd) -> float | None:
    """One optimizer step of this member, top to bottom (torchtitan's ``train_step``):

    1. plan: this member's slots of step ``t``;
    2. slots: forward and backward of each, the reducer taking each as it finishes and
       the last one's buckets on the wire behind its backward;
    3. wait for the buckets: the exact sum of every member's slots;
    4. non-finite check: bad slots re-run elsewhere, quarantined or blamed, recomputed;
       under ``fp16`` an overflow (finite loss, non-finite gradient) backs the loss scale
       off instead and the step is computed again at the new scale;
    5. the optimizer on this rank's shard (the sum divided by the loss scale under
       ``fp16``, clipped, the LR of step ``t``);
    6. commit: the step's loss-scale events, metrics, fingerprints, a due checkpoint
       (``end.after_update``).

    Steps 1-4 are :meth:`StepRunner.gradient`; every decision in them is a function of
    the slots, so the result is the same bits on every membership. Returns the loss
    (None for an overlapped outer step: :func:`overlapped_outer_step`)."""
    tr, t0 = run.tr, time.monotonic()
    tr.poison_due(t)  # a scheduled data fault (chaos): identical on every member
    if tr.computes_in_place:  # the slots write the state before the update does
        end.before_update()
    if run.overlap:
        overlapped_outer_step(run, t, end, t0)
        return None
    total = run.gradient(t, t0)  # 1-4
    end.before_update()
    loss = tr.apply(t, total)  # 5
    run.log_scale_changes()
    end.after_update(t, loss, time.monotonic() - t0)  # 6
    return loss


def overlapped_outer_step(run: StepRunner, t: int, end: StepEnd, t0: float) -> None:
    """Outer step ``t`` under ``outer.delay = 1``, its reduction behind the next step's
    replicas (streaming DiLoCo's overlap, the math :meth:`OuterStep.apply` defines):

    1. this member's replicas of step ``t`` from the parameters ``theta_t``, while step
       ``t - 1``'s reduction is still on the comm thread;
    2. settle step ``t - 1``'s reduction: its mean becomes the pending one, its metrics
       line is written (:meth:`StepRunner.settle`);
    3. start step ``t``'s reduction on the comm thread (:meth:`StepRunner.launch`);
    4. the update: step ``t - 1``'s mean moves the parameters to ``theta_t+1``
       (``Trainer.apply_pending``), which does not need step ``t``'s sum;
    5. the commit (evaluation, fingerprints and a due checkpoint settle step ``t`` first).

    A reduction lost with a member is undone at the epoch's end
    (:meth:`StepRunner.close_flight`): the state goes back to before step ``t``'s update
    and the next epoch redoes step ``t``, keeping this member's replicas of it."""
    run.outer_replicas(t, t0)  # 1
    run.settle()  # 2
    run.launch(t)  # 3
    end.before_update()
    run.tr.apply_pending(t)  # 4
    step_s = time.monotonic() - t0
    if run.flight is not None:
        run.flight.step_s = step_s
    end.after_update(t, None, step_s)  # 5


class Gate(Protocol):
    """What must finish before a member's first collective on the epoch's group."""

    def ready(self) -> bool:
        """Whether passing it now would not wait."""
        ...

    def __call__(self) -> None:
        """Wait until it is passed; raise what ended it (the epoch ends)."""
        ...


class StepRunner:
    """Computes, reduces and checks the gradient of each step this member takes part in."""

    def __init__(
        self,
        trainer: Trainer,
        plan: Plan,
        rank: int,
        comm: Comm,
        reducer: Reducer,
        seams: Seams,
        timer: SlotTimer,
        first: tuple[int, Plan] | None = None,
    ) -> None:
        """``first``: a step and its own plan (the step an epoch redoes after a loss,
        ``plan.redo_plan``); every other step follows ``plan``."""
        self.tr, self.plan, self.rank, self.comm = trainer, plan, rank, comm
        self.reducer, self.seams, self.timer = reducer, seams, timer
        self.verdicts = reducer
        """The reducer of the reruns' verdicts: the flat one where ``reducer`` scatters
        the slot buffers (a verdict is needed whole on every rank)."""
        if reducer.scatters:
            self.verdicts = make_reducer(trainer.config.train, rank, len(plan.members))
        self.first = first
        self.first_until = first[0] + 1 if first is not None else 0
        """The first step after ``first``'s plan: later than the step after it while a
        paced state copy's receivers have no slot (``member/copy_pacing.py``)."""
        self.partial: frozenset[int] = frozenset()
        """Ranks whose state is partial (a paced copy's receivers until its last part):
        no non-finite slot is re-run there."""
        self.slots = plan.slots_of(rank)
        self.bufs: list[torch.Tensor] = []
        train = trainer.config.train
        self.lockstep = train.shard_params
        """Parameters sharded at rest: a slot's gathers are collectives of the replica
        group, so every rank of a group computes as many slots (``passes``) and none is
        salvaged (a kept slot would skip its gathers on one rank only)."""
        k = train.shard_degree
        group = [r for r in range(self.size) if group_of(r, k) == group_of(rank, k)]
        self.passes = max(len(plan.slots_of(r)) for r in group) if self.lockstep else 0
        self._scratch: torch.Tensor | None = None
        outer = trainer.config.outer
        self.int8: Int8Gather | None = None
        """int8 DiLoCo: the pseudo-gradients go through an all-gather of int8 records,
        not the reducer (``comm/int8_gather.py``)."""
        if outer.on and outer.precision == "int8":
            compress = outer.wire_compression == "zlib"
            self.int8 = Int8Gather(trainer.layout, train.reduction_block, compress=compress)
        self.gate: Gate | None = None
        """Passed once before this member's first collective on the epoch's group (an
        overlapped state copy's holder: its copy must be served first, ``copy_overlap``)."""
        self.overlap = outer.on and outer.delay == 1
        """``outer.delay = 1``: an outer step's reduction runs behind the next step's
        replicas (:func:`overlapped_outer_step`)."""
        self.flight: OuterFlight | None = None
        """The overlapped outer step whose reduction is in flight, if any."""
        self._spare: list[torch.Tensor] = []
        self.settled: Callable[[int, float, float], None] = lambda step, loss, step_s: None
        """``(step, loss, step_s)``: an overlapped outer step's reduction is in (its
        metrics line; set by the worker)."""

    def open_gate(self) -> None:
        """Pass the gate (once): what must finish before this member's first collective."""
        gate, self.gate = self.gate, None
        if gate is not None:
            gate()

    def gate_waits(self) -> bool:
        """Whether passing the gate now would wait (a holder's copy still on its way)."""
        return self.gate is not None and not self.gate.ready()

    @property
    def size(self) -> int:
        return len(self.plan.members)

    def plan_at(self, t: int) -> Plan:
        """The plan of step ``t``: ``first``'s for its steps, else the epoch's."""
        first = self.first
        return first[1] if first is not None and first[0] <= t < self.first_until else self.plan

    def rerunner(self, owner: int) -> int:
        """The rank that re-runs a non-finite slot of ``owner``'s: the next one whose
        state is whole."""
        for i in range(1, self.size + 1):
            r = (owner + i) % self.size
            if r not in self.partial:
                return r
        raise AssertionError("every member's state is partial")

    def gradient(self, t: int, t0: float) -> torch.Tensor:
        """Steps 1-4 of :func:`train_step`: step ``t``'s exact sum, clean of non-finite
        slots (on its own: what the tests and benchmarks drive)."""
        # 1. The plan: this member's slots of step t (an epoch that redoes a step after a
        #    loss has a plan of its own for it), and the next step's samples read ahead.
        self.slots = self.plan_at(t).slots_of(self.rank)
        self.tr.prefetch(t + 1, self.plan_at(t + 1).slots_of(self.rank))
        self.tr.begin_step()  # at the committed loss scale (fp16)
        while True:
            # 2. Forward and backward of each slot (per-slot seeds); the reducer takes each
            #    finished slot, and the last slot's buckets go on the wire as its backward
            #    finishes them (DDP's overlap). 3. Wait for every bucket: the exact sum,
            #    the same bits on every member whoever computed which slot.
            total = self._attempt(t, t0)
            # 4. The non-finite check: the sum's flags name the slots; each is re-run on
            #    another member to tell bad data (quarantine) or an overflow (fp16: the
            #    loss scale backs off) from a bad worker (suspect).
            lay = self.tr.layout
            bad = lay.bad_slots(total)
            if not bad:
                return total
            if self.tr.outer is not None:  # every member sees the same flags
                raise MathError(
                    f"step {t}: the pseudo-gradients of virtual replicas {bad} are not finite "
                    "(outer.replicas: a non-finite inner step stops a DiLoCo run; its "
                    "quarantine path is not built)"
                )
            self.seams.salvage.clear()  # every slot of the step is computed again
            self._on_nonfinite(t, bad, set(lay.overflow_slots(total)))

    def _attempt(self, t: int, t0: float) -> torch.Tensor:
        if self.int8 is not None:
            return self._gather_int8(t, t0, self.int8)
        if self.reducer.carried:
            return self._carried(t, t0, cast(CarriedReduction, self.reducer))
        tr, slots = self.tr, self.slots
        abort = lambda: self.seams.should_stop(t)  # noqa: E731
        if len(self.bufs) != len(slots):
            self.bufs = [tr.layout.new_buffer() for _ in slots]
        key = (t, tr.state_version)
        computed = self._fill(t, key, range(len(slots) - 1), abort, None)
        self._pad(t, abort)  # before the reduction starts: it may begin with a collective
        delay = self.seams.delay_s()
        last = len(slots) - 1
        kept = self._take(key, slots[last], self.bufs[last])
        ready = None if kept else Readiness()
        fut = self._start_reduce(self.bufs, delay, ready, abort)
        if not kept:
            computed += self._fill(t, key, range(last, last + 1), abort, ready)
        if computed:  # compute speed only: a slow link shows in the heartbeats' lag
            self.timer.record(time.monotonic() - t0, computed)
        self._log_salvage(t)
        return self.comm.result(fut)

    def _gather_int8(self, t: int, t0: float, gather: Int8Gather) -> torch.Tensor:
        """int8 DiLoCo: this member's replicas, each in a buffer of its own and kept as the
        step form keeps slots (salvage), then the all-gather of their int8 records and the
        replica-order sum on every member (``comm/int8_gather.py``)."""
        tr, slots = self.tr, self.slots
        abort = lambda: self.seams.should_stop(t)  # noqa: E731
        if len(self.bufs) != len(slots):
            self.bufs = [tr.layout.new_buffer() for _ in slots]
        computed = self._fill(t, (t, tr.state_version), range(len(slots)), abort, None)
        if computed:
            self.timer.record(time.monotonic() - t0, computed)
        self._log_salvage(t)
        self._injected_drop()
        self.open_gate()
        plan = self.plan_at(t)
        width = max(len(plan.slots_of(r)) for r in range(self.size))
        delay, timeout = self.seams.delay_s(), self.seams.timeout()
        outer = self.tr.outer
        assert outer is not None
        fut = gather.start(self.comm, slots, self.bufs, width, timeout, delay, outer.estimates)
        total, estimates = self.comm.result(fut)
        if estimates is not None:  # outer.error_feedback: made current by the update
            outer.stage_estimates(estimates)
        return cast(torch.Tensor, total)

    # -- the overlapped outer step (outer.delay = 1) ------------------------------------------

    def outer_replicas(self, t: int, t0: float) -> None:
        """This member's replicas of outer step ``t`` into ``self.bufs`` (those it kept
        from an abandoned attempt copied), while the previous step's reduction is on the
        comm thread: no collective here."""
        tr = self.tr
        self.slots = self.plan_at(t).slots_of(self.rank)
        tr.prefetch(t + 1, self.plan_at(t + 1).slots_of(self.rank))
        tr.begin_step()
        abort = lambda: self.seams.should_stop(t)  # noqa: E731
        if len(self.bufs) != len(self.slots):
            self.bufs = [tr.layout.new_buffer() for _ in self.slots]
        computed = self._fill(t, (t, tr.state_version), range(len(self.slots)), abort, None)
        if computed:
            self.timer.record(time.monotonic() - t0, computed)
        self._log_salvage(t)

    def launch(self, t: int) -> None:
        """Start outer step ``t``'s reduction on the comm thread (int8: its records'
        all-gather, encoded now against the estimates the last settled step left) and
        hand this member's replica buffers to it: the next step's go to the spare set."""
        assert self.flight is None, "an outer step launched over one in flight"
        self._injected_drop()
        self.open_gate()
        delay, timeout = self.seams.delay_s(), self.seams.timeout()
        if self.int8 is not None:
            plan = self.plan_at(t)
            width = max(len(plan.slots_of(r)) for r in range(self.size))
            outer = self.tr.outer
            assert outer is not None
            fut = self.int8.start(
                self.comm, self.slots, self.bufs, width, timeout, delay, outer.estimates
            )
        else:
            abort = lambda: self.seams.should_stop(t)  # noqa: E731
            fut = self.reducer.start(
                self.comm, self.bufs, timeout=timeout, abort=abort, send_delay_s=delay
            )
        self.flight = OuterFlight(t, fut, list(self.slots), self.bufs)
        self.bufs, self._spare = self._spare, []

    def settle(self) -> None:
        """Wait for the outer step in flight, if any (leaving once that step must be
        abandoned: a member was lost), then commit it: the non-finite check, its mean
        pending (``Trainer.settle_outer``), its metrics line (:attr:`settled`). Raises
        Abandoned or CommFailed with the flight kept, for :meth:`close_flight` to undo."""
        f = self.flight
        if f is None:
            return
        result = self.comm.result(f.fut, abort=lambda: self.seams.should_stop(f.step))
        total, estimates = result if self.int8 is not None else (result, None)
        bad = self.tr.layout.bad_slots(total)
        if bad:
            raise MathError(
                f"step {f.step}: the pseudo-gradients of virtual replicas {bad} are not finite "
                "(outer.replicas: a non-finite inner step stops a DiLoCo run; its "
                "quarantine path is not built)"
            )
        outer = self.tr.outer
        assert outer is not None
        if estimates is not None:  # outer.error_feedback: made current by settle_outer
            outer.stage_estimates(estimates)
        loss = self.tr.settle_outer(f.step, total)
        self.flight, self._spare = None, f.bufs
        self.settled(f.step, loss, f.step_s)

    def close_flight(self) -> None:
        """The epoch ends: settle the outer step in flight, or where its reduction was
        lost (or cannot be trusted), undo its update (``Trainer.undo_outer``): the
        member reports the step before it, with its own replicas of that step kept
        (salvage), and the next epoch redoes the step, the same bits as if nothing had
        happened. Either way no reduction is in flight afterwards."""
        f = self.flight
        if f is None:
            return
        try:
            self.settle()
            return
        except (Abandoned, CommFailed) as e:
            why = str(e)
        except Exception as e:  # the next epoch redoes the step and meets it again
            why = f"{type(e).__name__}: {e}"
        self.flight = None
        t = self.tr.undo_outer()
        assert t == f.step, (t, f.step)
        self.seams.salvage.clear()
        for slot, buf in zip(f.slots, f.bufs, strict=True):
            self._keep((t, self.tr.state_version), slot, buf)
        self.seams.events.write(
            {"event": ev.OUTER_UNDONE, "worker": self.seams.name, "step": t, "why": why[:200]}
        )

    def _take(self, key: tuple[int, int], slot: int, buf: torch.Tensor) -> bool:
        return not self.lockstep and self.seams.salvage.take(key, slot, buf)

    def _keep(self, key: tuple[int, int], slot: int, buf: torch.Tensor) -> None:
        if not self.lockstep:
            self.seams.salvage.put(key, slot, buf)

    def _pad(self, t: int, abort: Callable[[], bool], red: CarriedReduction | None = None) -> None:
        """Sharded at rest: the throwaway slots that keep this rank's gathers in step with
        its group's busiest rank (the gradient goes to a scratch buffer, unused). Run
        before the reduction starts, so that every rank enters it after as many slots
        (the reduction can open with a collective of the epoch, and a rank waiting in it
        would starve its group's gathers); ``red`` (a pass's) is told of each
        (``skip``: where every slot is a round of the group's, a round of zeros)."""
        extra = self.passes - len(self.slots)
        if extra <= 0:
            return
        if self._scratch is None:
            self._scratch = self.tr.layout.new_buffer()
        slot = self.slots[0] if self.slots else 0
        for _ in range(extra):
            if not self.tr.compute_slots(t, range(slot, slot + 1), [self._scratch], abort):
                raise Abandoned("membership epoch changed during compute")
            if red is not None:
                red.skip(self.comm, timeout=self.seams.timeout(), abort=abort)

    def _carried(self, t: int, t0: float, red: CarriedReduction) -> torch.Tensor:
        """A reducer with carried exponents (``comm/carried.py``, ``comm/streamed.py``):
        one slot buffer, each slot added as it finishes and the last streamed behind its
        backward. A prediction that the step's true maxima refuse (and the first step's
        missing one) computes the step again against them."""
        pred = self.tr.exponents
        used = None if pred is None else red.used(pred)
        total, maxima = self._stream(t, red, used, t0)
        self._log_salvage(t)
        if total is None or pred is None or not red.accepts(pred, maxima):
            if pred is not None and self.rank == 0:
                self.seams.events.write({"event": ev.EXPONENTS_REFIT, "step": t})
            total, maxima = self._stream(t, red, red.fitted(maxima))
        assert total is not None
        self.tr.stage_exponents(red.predict(pred, maxima))
        return total

    def _stream(
        self, t: int, red: CarriedReduction, used: Any, t0: float | None = None
    ) -> tuple[torch.Tensor | None, Any]:
        """One pass over this member's slots of step ``t``: the sum rounded against
        ``used`` (None: no sum) and the step's true maxima. Each slot but the last is
        handed to the reducer (as its backward runs, where it reduces every slot:
        ``begin_slot``); the last slot's buckets go on the wire as its backward finishes
        them. ``t0``: the step's start, to time the compute (the first pass only)."""
        if len(self.bufs) != 1:
            self.bufs = [self.tr.layout.new_buffer()]
        buf = self.bufs[0]
        abort = lambda: self.seams.should_stop(t)  # noqa: E731
        timeout = self.seams.timeout()
        key = (t, self.tr.state_version)
        kept, partial = self._kept_sum(key) if used is not None else ((), None)
        resumed = red.open(
            buf, used, adds=max(0, len(self.slots) - 1), rounds=self._rounds(t), resume=partial
        )
        added = list(kept) if resumed else []  # the slots the accumulator holds
        if resumed:
            self.seams.salvage.reused_sum(kept)
        todo = [s for s in self.slots if s not in added]
        # Sharded at rest, a slot's gathers are collectives of the replica group: no slot
        # streams (a backward held by its reduction would starve its group's gathers).
        streams = not self.lockstep
        try:  # until the last slot goes on the wire, an abandoned pass keeps its sum
            for slot in todo[:-1]:
                ready = red.begin_slot(self.comm, timeout=timeout, abort=abort, stream=streams)
                self._compute(t, slot, buf, abort, ready)
                red.add(buf)
                added.append(slot)
            self._pad(t, abort, red)  # before the last slot: every rank passes as often
            # A holder whose copy is still out computes its last slot whole before the
            # gate rather than wait at it idle: no bucket could go on the wire before the
            # copy is served, and the sum's integers are the same bits either way.
            streams = streams and not self.gate_waits()
            if todo and not streams:
                self._compute(t, todo[-1], buf, abort, None)
            self._injected_drop()
            self.open_gate()
        except (Abandoned, CommFailed):
            self._keep_sum(key, red, tuple(added))
            raise
        ready = Readiness(abort) if todo and streams else None
        fut = red.finish(
            self.comm,
            buf,
            last=buf if todo else None,
            ready=ready,
            abort=abort,
            timeout=timeout,
            send_delay_s=self.seams.delay_s(),
        )
        try:  # once every bucket is sent, the reducer may still hold the member's sum
            if ready is not None:
                self._compute(t, todo[-1], buf, abort, ready)
            if t0 is not None and todo:
                self.timer.record(time.monotonic() - t0, len(todo))
            return self.comm.result(fut)
        except (Abandoned, CommFailed):
            self._keep_sum(key, red, tuple(self.slots))
            raise

    def _kept_sum(self, key: tuple[int, int]) -> tuple[tuple[int, ...], Any]:
        """A partial sum an abandoned pass of this step kept, if every slot of it is among
        this member's (``replica/salvage.py``); never sharded at rest (lockstep passes)."""
        if self.lockstep:
            return (), None
        return self.seams.salvage.take_sum(key, self.slots)

    def _keep_sum(
        self, key: tuple[int, int], red: CarriedReduction, slots: tuple[int, ...]
    ) -> None:
        """The pass is abandoned: keep the sum of ``slots`` where the reducer still holds
        it (``partial``: between slots, those added; after the last bucket, all)."""
        if self.lockstep or not slots:
            return
        partial = red.partial()
        if partial is not None:
            self.seams.salvage.put_sum(key, slots, partial)

    def _rounds(self, t: int) -> int:
        """The most slots a rank of this member's replica group computes in step ``t``."""
        plan, k = self.plan_at(t), self.tr.config.train.shard_degree
        group = [r for r in range(self.size) if group_of(r, k) == group_of(self.rank, k)]
        return max(len(plan.slots_of(r)) for r in group)

    def _compute(
        self, t: int, slot: int, buf: torch.Tensor, abort: Callable[[], bool], ready: Any
    ) -> None:
        if not self.tr.compute_slots(t, range(slot, slot + 1), [buf], abort, ready=ready):
            raise Abandoned("membership epoch changed during compute")

    def _log_salvage(self, t: int) -> None:
        reused = self.seams.salvage.pop_reused()
        if reused:
            self.seams.events.write(
                {"event": ev.SLOTS_SALVAGED, "worker": self.seams.name, "step": t, "slots": reused}
            )

    def _fill(
        self,
        t: int,
        key: tuple[int, int],
        indices: range,
        abort: Callable[[], bool],
        ready: Readiness | None,
    ) -> int:
        """Fill ``self.bufs[i]`` for ``i`` in ``indices``: a kept slot of this step is
        copied, the others computed (and kept). Returns how many were computed."""
        computed = 0
        for i in indices:
            slot, buf = self.slots[i], self.bufs[i]
            if self._take(key, slot, buf):
                self._keep(key, slot, buf)
                continue
            if not self.tr.compute_slots(t, range(slot, slot + 1), [buf], abort, ready=ready):
                raise Abandoned("membership epoch changed during compute")
            self._keep(key, slot, buf)
            computed += 1
        return computed

    def _start_reduce(
        self,
        bufs: list[torch.Tensor],
        delay: float,
        ready: Readiness | None,
        abort: Callable[[], bool],
        reducer: Reducer | None = None,
    ) -> Any:
        self._injected_drop()
        self.open_gate()
        return (reducer or self.reducer).start(
            self.comm,
            bufs,
            timeout=self.seams.timeout(),
            ready=ready,
            abort=abort,
            send_delay_s=delay,
        )

    def _injected_drop(self) -> None:
        if self.seams.take_comm_error():
            self.seams.events.write(
                {"event": ev.FAULT_HIT, "kind": "comm_error", "worker": self.seams.name}
            )
            raise CommFailed("injected link drop (comm_error)")

    def _reduce(self, bufs: list[torch.Tensor]) -> torch.Tensor:
        """The slot-ordered sum of every member's ``bufs`` (all final already)."""
        fut = self._start_reduce(bufs, 0.0, None, lambda: False, self.verdicts)
        return self.comm.result(fut)

    # -- non-finite slots ------------------------------------------------------------------

    def _on_nonfinite(self, t: int, bad: list[int], overflow: set[int]) -> None:
        """Re-run each bad slot on another member to tell bad data from a bad worker, and
        the first overflowing one (``overflow``, under ``fp16``), whole, to tell an
        overflow (reproduced: the loss scale backs off) from a bad worker. An overflow
        never quarantines data nor blames a worker that reported it truly: every decision
        here is a function of the reduced flags and verdicts, the same on every
        membership.

        One overflowing slot is re-run, not each: a reproduced one proves the overflow
        (the scale must back off whatever the others are), and the step is then computed
        again, every slot at the new scale; an unreproduced one makes its owner a suspect
        and the step is computed again at the same scale, where the next flagged slot is
        tried. So the scale's path is the data's, at the cost of one slot per overflow."""
        per = self.tr.config.train.slot_size
        vec = torch.zeros(self.tr.config.train.slots * per, device=self.comm.device)
        plan = self.plan_at(t)
        owner = {s: r for r in range(self.size) for s in plan.slots_of(r)}
        probe = min(overflow, default=None)
        with self.tr.params_whole():  # the reruns are on some ranks only
            for s in bad:
                if self.rerunner(owner[s]) != self.rank or (s in overflow and s != probe):
                    continue
                if s == probe:  # 1: it overflows here too
                    vec[s * per] = float(self.tr.rerun_overflows(t, s))
                    continue
                flags = self.tr.rerun_flags(t, s)  # FINITE, NON_FINITE or WITHHELD each
                vec[s * per : (s + 1) * per] = torch.tensor(flags, dtype=torch.float32)
        verdict = self._reduce([vec]).cpu()
        found: dict[int, list[int]] = {}
        overflowed = False
        for s in bad:
            flags = [round(float(x)) for x in verdict[s * per : (s + 1) * per]]
            if s == probe and flags[0]:
                overflowed = True
            elif s == probe:
                self._suspect(t, s, self.plan.members[owner[s]])
            elif s in overflow:
                continue  # decided by the probe's verdict
            elif any(flags):
                found[s] = flags
            else:
                self._suspect(t, s, self.plan.members[owner[s]])
        # A slot whose samples were withheld (their shard has no good copy in the store of
        # the member that re-ran it: WITHHELD) is the storage's fault: never the model's.
        withheld = any(WITHHELD in flags for flags in found.values())
        if len(found) == self.tr.config.train.slots and not withheld:
            fp16 = self.tr.config.train.precision == "fp16"
            raise MathError(
                f"step {t}: every slot's gradient is non-finite, on every worker that re-ran "
                "it: the model or the optimizer, not the data (check the loss function and "
                "optim settings"
                + ("; under train.precision = 'fp16' also a forward beyond float16's range, "
                   "which no loss scale cures: try 'bf16')" if fp16 else ")")
            )  # fmt: skip
        if found:
            for entry in self.tr.quarantine(t, found):
                if self.rank == 0:
                    self.seams.events.write({"event": ev.DECISION, **entry})
        if overflowed:
            self.tr.back_off(t, sorted(overflow))  # logged when the step commits

    def log_scale_changes(self) -> None:
        """The applied step's loss-scale changes (``loss_scale`` events), by rank 0: every
        member made the same ones."""
        for change in self.tr.take_scale_changes():
            if self.rank == 0:
                self.seams.events.write({"event": ev.LOSS_SCALE, **change})

    def _suspect(self, step: int, slot: int, worker: str) -> None:
        """A non-finite slot that did not reproduce elsewhere: the worker, not the data.
        Its result is discarded (the step is recomputed); past the configured count it is
        evicted. Every member counts identically, so rank 0 alone reports."""
        suspects = self.seams.suspects
        suspects[worker] = suspects.get(worker, 0) + 1
        if self.rank != 0:
            return
        self.seams.events.write(
            {
                "event": ev.SUSPECT_WORKER,
                "step": step,
                "slot": slot,
                "worker": worker,
                "count": suspects[worker],
            }
        )
        if suspects[worker] >= self.seams.evict_after:
            self.seams.evict(worker, "non-finite results")

    # -- fingerprints ----------------------------------------------------------------------

    def any_member(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any member (``Comm.any_rank``)."""
        self.settle()
        return self.comm.any_rank(flag, self.seams.timeout())

    def compare_fingerprints(self) -> bool:
        """Whether this replica agrees with the majority (a CRC per tensor of the model's
        parameters and buffers); the odd ones out are logged with the tensors that differ.
        False: this replica must drop its state and receive a peer's.

        Without a strict majority (two replicas that differ, three that all differ) no
        replica can be trusted over another: the model's state is not a function of the
        slots (a buffer or parameter changed outside the step's math), and the run stops
        with a :class:`MathError` naming the tensors.

        Sharded at rest, a rank holds its shard's parameters only (-1 in its CRCs for the
        others): replicas are compared within each set of ranks that hold the same
        tensors."""
        self.settle()  # the step in flight's collective comes first on every member
        crcs = self.tr.fingerprint()
        dev = self.comm.device
        mine = torch.tensor(crcs, dtype=torch.int64, device=dev)
        outs = [torch.zeros(len(crcs), dtype=torch.int64, device=dev) for _ in range(self.size)]
        timeout = self.seams.timeout()
        self.comm.call(lambda: self.comm.pg.allgather([outs], [mine]).wait(timeout))
        values = [tuple(int(x) for x in o.cpu()) for o in outs]
        if len(set(values)) == 1:
            return True
        names = self.tr.fingerprint_names()
        odd: list[str] = []
        differ: set[str] = set()
        lost = False
        for ranks in _holding_classes(values):
            vs = [values[r] for r in ranks]
            majority = max(set(vs), key=vs.count)
            odd += [self.plan.members[r] for r in ranks if values[r] != majority]
            differ |= {
                names[i]
                for v in vs
                for i, (a, b) in enumerate(zip(v, majority, strict=True))
                if a != b
            }
            lost = lost or 2 * vs.count(majority) <= len(vs)
        if not odd:
            return True
        step, tensors = self.tr.next_step, sorted(differ)
        self.seams.events.write(
            {"event": ev.REPLICA_DIVERGED, "step": step, "workers": odd, "tensors": tensors}
        )
        if lost:
            raise MathError(
                f"step {step}: replicas {list(self.plan.members)} hold different model state "
                f"and no majority agrees; tensors that differ: {', '.join(tensors[:8])}"
                f"{' ...' if len(tensors) > 8 else ''} (the model changes state outside the "
                "step's math: see docs/architecture.md, 'Buffers')"
            )
        return self.seams.name not in odd


def _holding_classes(values: list[tuple[int, ...]]) -> list[list[int]]:
    """The ranks grouped by which tensors they hold (-1: not held), in rank order."""
    classes: dict[tuple[bool, ...], list[int]] = {}
    for r, v in enumerate(values):
        classes.setdefault(tuple(x == -1 for x in v), []).append(r)
    return list(classes.values())
