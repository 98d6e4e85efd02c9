"""The streamed exact reduction: per-block exponents known before the backward, 32- or
64-bit integers, and every bucket on the wire the moment the backward has finished it
(``train.reduction_exponents = "streamed"``).

The ``step`` form (``exact.py``) must learn every block's exponent from a MAX round after
the last slot, and the ``carried`` form (``carried.py``) predicts one exponent per bucket of
a million values, which leaves too few bits for 32-bit integers. Here each block of
``block`` values carries its own prediction, so 32-bit integers keep float32's precision
and the wire carries DDP's bytes:

- **Predict.** Block ``j``'s exponent for step ``t`` is step ``t - 1``'s true maximum
  exponent of the block plus ``MARGIN`` bits; a block that was all zeros keeps its last
  prediction (an embedding row that no token of the step touched), and a block never seen
  non-zero takes the largest prediction of the buffer. The predictions are state of the
  run (``Trainer.exponents``: an int32 tensor in checkpoints and state copies).
- **Accumulate and stream.** Each of a member's slots but its last is rounded against the
  predictions and added to one integer accumulator the moment its backward is done, so its
  float buffer takes the next slot. The last slot's buffer is read by the comm thread as
  its backward finishes it (``Readiness``: the buffer holds the parameters in reverse
  registration order, the order the backward finishes them, as DDP's buckets): each
  bucket (``exact._bucket_ranges``: fixed by the buffer's length and ``block``, never by W
  or k) is rounded, added and handed to the backend's ``all_reduce`` (or the replica
  group's reduce-scatter, ``scatter.py``) at once, while the backward goes on. Integer
  addition is associative: the launch order, the grouping and the algorithm cannot change
  a bit.
- **Outliers, not recomputes.** A slot's block whose largest value reaches ``2**e`` of its
  prediction ``e`` (the gradient grew more than the margin) is left out of the integers
  (zeros) and kept as floats. The step's true block maxima over every slot of every rank
  come from a MAX all-reduce of one int32 per block (``1/block`` of the buffer: 0.4 % of
  DDP's bytes at 256), sent behind the last bucket; every block above its prediction then
  goes through the *outlier lane*: each member rounds its kept slot blocks against the
  block's true maximum (the ``step`` form's rounding, same width), one all-reduce of
  those blocks sums them, and the block's result is the lane's sum plus the main
  integers, on one grid in int64, converted once. Which slot block is an outlier is a
  function of its values and the prediction alone, so this too is the same bits whoever
  computed which slot; a missed prediction costs one small all-reduce, not a second
  compute pass.
- **Fall back.** A member that would keep more than ``1/CAP_FRACTION`` of the buffer
  (at least ``CAP_FLOOR`` values) as outliers (a gradient that exploded everywhere) flags
  it in the MAX; every member then computes the step's slots again against the true
  maxima, which cannot fail. A run's first step (nothing predicted yet) takes its maxima
  from a pass that only measures.

Every decision is a function of the slot gradients and of the previous step's maxima,
themselves a function of the trajectory: whoever computed which slot, every rank takes
the same outlier blocks or falls back identically and the result is the same bits. The
rounding (per block, against the prediction) differs from the other forms', so it is a
math setting.

Accuracy: a value is kept to ``bits - 2 - headroom - (used - its block's maximum)`` bits
below its block's maximum, ``headroom = ceil(log2 S)``: with 32-bit integers, 8 slots and
the margin of 3, 24 bits at a block's maximum when it moved as predicted (float32 has 24);
a block whose maximum shrank by ``d`` bits more than the margin keeps ``d`` bits fewer for
that step (the next prediction follows it); an outlier block keeps ``bits - 2 - headroom``
for its outlier slots, as the ``step`` form does.

Across regions (``cluster.hierarchical_reduce``, ``tiers.py``) the buckets stream too
(``TieredBuckets``): each goes to its region's all-reduce as the backward finishes it, then
to the leaders' direct exchange (a tag per bucket, the receives posted before the
backward) as soon as its region's sum is done, several in flight; the MAX of the block
maxima goes the same way beside the last bucket; the broadcasts inside each region
follow the last bucket.

With several slots a rank in replica groups and ``train.shard_reduce_slots = "each"``,
every slot streams so, each in a round of its own (:class:`Rounds`): its buckets are
reduce-scattered inside the group as its backward finishes them and the group's sum of
the rank's range is added into a ``P / k`` accumulator, so no rank holds P integers; the
range goes across groups once, after the last round. The same integers are added, so the
same bits.

Limits: the first step costs a second compute pass; a member's finished slots are not
salvaged across a membership change (they are inside its accumulator); across regions a
step still pays about one one-way delay over the slow links after its backward (the last
bucket and the maxima, together).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from perdure.runtime.comm.exact import ExactReducer, _bucket_ranges, _zero_non_finite
from perdure.runtime.comm.readiness import Readiness
from perdure.runtime.comm.scatter import Scatter, ScatterExchange
from perdure.runtime.comm.tiers import TieredBuckets, Tiers, tiered_allreduce

MARGIN = 3
"""Bits a block's prediction sits above the previous step's maximum: a block may grow 8x
from one step to the next before it takes the outlier lane (measured on the 5M tiny_lm:
with 2 bits about 5 % of the blocks took it every step, 10 % more bytes on the wire)."""
ZERO = -(1 << 20)
"""A block's maximum when its values are all zero; as a prediction: never seen non-zero."""


def _idle() -> None:
    """Nothing in flight to advance."""


def _ticked(tick: Callable[[], None], abort: Callable[[], bool]) -> bool:
    """``abort()``, after ``tick()``: the readiness wait's check, run every few
    milliseconds while the backward computes, also moves the buckets in flight on."""
    tick()
    return abort()


# -- the pure part: predictions and their verdict ------------------------------------------


def used(pred: torch.Tensor) -> torch.Tensor:
    """The exponents a step is rounded against: each block's prediction, the buffer's
    largest for a block never seen non-zero."""
    seen = pred != ZERO
    top = int(pred[seen].max()) if bool(seen.any()) else 0
    return torch.where(seen, pred, torch.full_like(pred, top))


def fitted(maxima: torch.Tensor) -> torch.Tensor:
    """The exponents a missed step is computed again with: the maxima themselves (an
    all-zero block takes the buffer's largest, which rounds its zeros to zeros)."""
    return used(maxima)


def predict(pred: torch.Tensor | None, maxima: torch.Tensor) -> torch.Tensor:
    """The next step's predictions: ``MARGIN`` bits above each non-zero maximum; an
    all-zero block keeps its prediction."""
    keep = torch.full_like(maxima, ZERO) if pred is None else pred
    return torch.where(maxima != ZERO, maxima + MARGIN, keep)


def maxima_of(peaks: torch.Tensor) -> torch.Tensor:
    """Each block's true exponent (the smallest ``e`` with ``|g| < 2**e``) from its peak's
    bits (int32 storage, finite), ``ZERO`` for an all-zero block."""
    exps = torch.frexp(peaks.view(torch.float32))[1].to(torch.int32)
    return torch.where(peaks == 0, torch.full_like(exps, ZERO), exps)


CAP_FRACTION = 64
"""A member keeps at most ``1/CAP_FRACTION`` of the buffer's values as outliers (1.6 %, as
floats), or ``CAP_FLOOR`` for a small buffer; past that every member computes the pass
again against the true maxima."""
CAP_FLOOR = 1 << 16


class Outliers:
    """A member's slot blocks that exceeded their exponent, kept as floats until the step's
    true maxima say what grid they are rounded onto (the outlier lane)."""

    def __init__(self, block: int, cap: int) -> None:
        self.block, self.cap = block, cap
        self.kept: list[tuple[int, torch.Tensor]] = []
        self.count = 0
        self.full = False

    def keep(self, j: int, values: torch.Tensor) -> None:
        """Block ``j`` of one slot (a copy is kept; past the cap only the flag is)."""
        if self.count + values.numel() > self.cap:
            self.full = True
            return
        self.kept.append((j, values.clone()))
        self.count += values.numel()

    def lane(self, over: torch.Tensor, k: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[len(over), block]`` of ``dtype``: per block of ``over``, this member's kept
        values rounded against ``2**k`` of that block (half to even, exact in float32: a
        power-of-two scaling) and summed."""
        row = {j: r for r, j in enumerate(over.tolist())}
        lane = torch.zeros(len(row), self.block, dtype=dtype)
        scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
        for j, values in self.kept:
            r = row[j]
            lane[r, : values.numel()] += (values * scale[r]).round_().to(dtype)
        return lane


@dataclass
class PartialSum:
    """What a summing pass holds after some of a member's slots (:meth:`StreamedReducer.
    partial`): their integers added, their block peaks merged, their outlier blocks kept,
    all against ``exps``. Integer addition is associative and the peaks a maximum, so a
    later pass of the same step against the same exponents can start from it and add the
    other slots in any order: the same bits as one pass over them all."""

    exps: torch.Tensor
    ints: torch.Tensor
    peaks: torch.Tensor
    outliers: Outliers
    added: int


class Rounds:
    """One pass's rounds under ``train.shard_reduce_slots = "each"``: every slot of a rank
    is reduce-scattered inside its replica group as a round of its own, and the group's
    sum of the rank's range is added into :attr:`acc` (``P / k`` integers, not ``P``).
    Every rank of a group runs ``total`` rounds (its group's most slots), one per slot and
    rounds of zeros for the slots it lacks, since the group's collectives must match;
    the tail (buffer moves, flags, losses: every rank needs it whole) is added up locally
    and all-reduced once with the range at the end. Integer addition is associative:
    the rounds give the bits of one reduction of the summed slots."""

    def __init__(self, total: int, sc: Scatter, dtype: torch.dtype, device: torch.device) -> None:
        """``device``: the slot buffers' (the rounds' sums land beside them: a CUDA
        buffer's collectives are NCCL's, on the device)."""
        self.total, self.done = total, 0
        self.lo, self.hi = sc.mine
        self.numel = sc.numel
        self.acc = torch.zeros(self.hi - self.lo, dtype=dtype, device=device)
        self.tail = torch.zeros(sc.size - sc.numel, dtype=dtype, device=device)

    @property
    def left(self) -> int:
        return self.total - self.done

    @property
    def nbytes(self) -> int:
        """What the rank holds for the sum beside the slot buffer."""
        return (self.acc.numel() + self.tail.numel()) * self.acc.element_size()

    def fold(self, x: int, y: int, part: torch.Tensor) -> None:
        """The group's sum of ``[x, y)`` (inside the rank's range) for this round."""
        self.acc[x - self.lo : y - self.lo] += part

    def end_round(self, ints: torch.Tensor) -> None:
        """The round's tail (this rank's own values: the tail is not exchanged per round)."""
        self.tail += ints[self.numel :]
        self.done += 1

    def put_back(self, ints: torch.Tensor) -> None:
        """The accumulated range and tail into the integer buffer, for the exchange across
        groups; the accumulator's memory goes."""
        ints[self.lo : self.hi] = self.acc
        ints[self.numel :] = self.tail
        self.acc = self.acc[:0]


# -- one member's side ---------------------------------------------------------------------


class StreamedReducer:
    """Adds a member's slots into one accumulator as they finish and streams the last one's
    buckets behind its backward (the module doc). Whole-buffer reductions (the re-runs'
    flags) go through the ``step`` form, ``start``."""

    carried = True

    @property
    def scatters(self) -> bool:
        return self.scatter is not None

    """The step keeps one slot buffer and asks :meth:`open`/:meth:`add`/:meth:`finish`."""

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        slots: int,
        bits: int,
        block: int,
        fused: bool = True,
        scatter: Scatter | None = None,
        each: bool = False,
    ) -> None:
        """``each``: reduce-scatter every slot in its own round (``Rounds``,
        ``train.shard_reduce_slots = "each"``), where the pass scatters at all."""
        self.exact = ExactReducer(rank, size, slots=slots, bits=bits, block=block, fused=fused)
        self.size, self.block, self.bits, self.scatter = size, block, bits, scatter
        self.each = each and scatter is not None and size > 1
        self.rounds: Rounds | None = None
        self.held_peak = 0
        """The most bytes this reducer held for a pass's sum beside the slot buffer (its
        integer accumulator, or the rounds' ``P / k`` one): a deterministic count of the
        gradient side's extra, for tests and benchmarks."""
        self._comm: tuple[Any, timedelta, Callable[[], bool]] | None = None
        """The comm, timeout and abort of the pass's rounds (``begin_slot``)."""
        self._like = torch.zeros(0)
        self._streaming = False
        self._error: BaseException | None = None
        self.start = self.exact.start
        self.n, self.added, self.summing = 0, 0, False
        self.peaks = torch.zeros(0, dtype=torch.int32)
        self.ints = torch.zeros(0, dtype=self.exact.dtype)
        self.exps = torch.zeros(0, dtype=torch.int32)
        self.outliers = Outliers(block, cap=block)
        self.aliased = False
        """The integers are the float buffer's own bytes (:meth:`open`)."""
        self._phase = "adding"
        """Where the pass is, for :meth:`partial`: ``adding`` (slots added, nothing sent),
        ``finishing`` (the last slot is being added and sent: the integers are no longer
        this member's sum alone), ``sent`` (every bucket added and on the wire from a copy
        of its own, ``_wire``: :attr:`own` is this member's whole sum)."""
        self.own: torch.Tensor | None = None

    # -- the step's calls --------------------------------------------------------------

    def open(
        self,
        like: torch.Tensor,
        exps: torch.Tensor | None,
        *,
        adds: int = 1,
        rounds: int = 0,
        resume: PartialSum | None = None,
    ) -> bool:
        """Begin a pass over one step's slots, rounded against ``exps`` (one per block:
        :meth:`used` of the prediction, or :meth:`fitted` maxima), or None for a pass
        that only measures the maxima. ``adds``: the slots :meth:`add` will take before
        :meth:`finish`; with none (one slot a member) and 32 bits the integers live in
        ``like`` itself, each value converted in place (a float32 and an int32 have one
        size), so the member holds one buffer of P values, not two. ``rounds``: the most
        slots a rank of this member's replica group computes in the pass (``each``: the
        rounds every rank of the group runs). ``resume``: an abandoned pass's
        :meth:`partial` of this step, whose slots the caller does not compute again; taken
        (True) where this pass sums against the same exponents without rounds, and it then
        counts among ``adds``."""
        n = like.numel()
        nblocks = -(-n // self.block)
        if exps is not None and exps.numel() != nblocks:
            raise ValueError(
                f"streamed exponents: {exps.numel()} blocks for a buffer of {nblocks} "
                f"(train.reduction_block = {self.block})"
            )
        self.n, self.added, self.summing = n, 0, exps is not None
        self._phase, self.own = "adding", None
        self.peaks = torch.zeros(nblocks, dtype=torch.int32)
        sc, self._error, self._like, self._streaming = self.scatter, None, like, False
        # with one round a group, the rank's one slot is that round: reduced once
        each = self.each and self.summing and rounds > 1 and sc is not None and n == sc.size
        assert not each or rounds >= adds + 1, "a group's rounds below a member's slots"
        self.rounds = (
            Rounds(rounds, sc, self.exact.dtype, like.device) if each and sc is not None else None
        )
        self.aliased = (
            (adds == 0 or self.rounds is not None)  # each slot is sent before the next
            and self.bits == 32
            and like.dtype == torch.float32
            and like.is_contiguous()
        )
        if self.aliased:
            self.ints = like.view(torch.int32)
        elif self.ints.numel() != n or self.ints.untyped_storage().data_ptr() == (
            like.untyped_storage().data_ptr()
        ):
            self.ints = torch.empty(n, dtype=self.exact.dtype, device=like.device)
        self.outliers = Outliers(self.block, cap=max(CAP_FLOOR, n // CAP_FRACTION))
        if self.rounds is not None:
            held = self.rounds.nbytes + (0 if self.aliased else self.ints.nbytes)
        else:
            held = 0 if self.aliased or not self.summing else self.ints.nbytes
        self.held_peak = max(self.held_peak, held)
        if exps is None:
            return False
        self.exps = exps
        k = self.exact._shift(exps)
        self.scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
        self.inv = torch.ldexp(torch.ones_like(k, dtype=torch.float32), -k)
        return resume is not None and self._resume(resume)

    def _resume(self, kept: PartialSum) -> bool:
        """Start from ``kept`` (see :meth:`open`): its integers become the accumulator."""
        ok = (
            self.rounds is None
            and not self.aliased
            and kept.ints.shape == self.ints.shape
            and kept.ints.dtype == self.ints.dtype
            and kept.ints.device == self.ints.device
            and torch.equal(kept.exps, self.exps)
        )
        if ok:
            self.ints, self.peaks, self.outliers = kept.ints, kept.peaks, kept.outliers
            self.added = kept.added
            self.held_peak = max(self.held_peak, self.ints.nbytes)
        return ok

    def partial(self) -> PartialSum | None:
        """The pass's sum so far, for a later pass of the same step (salvage across a
        membership change): between slots, before :meth:`finish`, the slots added; once
        :meth:`finish` has added the last slot and sent every bucket from a copy
        (``_wire``), the member's whole sum, however the reduction then ended; None
        otherwise (a pass with rounds, a measuring one, nothing added, or the last slot
        on its way into the integers). The reducer lets go of the integers (its next pass
        allocates its own), so the kept sum is never written."""
        if not self.summing or self.rounds is not None or self.aliased:
            return None
        if self._phase == "sent" and self.own is not None:
            kept = PartialSum(self.exps, self.own, self.peaks, self.outliers, self.added + 1)
        elif self._phase == "adding" and self.added > 0:
            kept = PartialSum(self.exps, self.ints, self.peaks, self.outliers, self.added)
        else:
            return None
        self.ints, self.own, self._phase = torch.zeros(0, dtype=self.exact.dtype), None, "taken"
        return kept

    # the carried state's rules, for the step (pure: the module's functions)

    def used(self, pred: torch.Tensor) -> torch.Tensor:
        return used(pred)

    def accepts(self, pred: torch.Tensor, maxima: torch.Tensor) -> bool:
        """Always: a block above its prediction went through the outlier lane (a pass
        whose outliers overflowed their cap returns no sum, and is computed again)."""
        return True

    def fitted(self, maxima: torch.Tensor) -> torch.Tensor:
        return fitted(maxima)

    def predict(self, pred: torch.Tensor | None, maxima: torch.Tensor) -> torch.Tensor:
        return predict(pred, maxima)

    def begin_slot(
        self, comm: Any, *, timeout: timedelta, abort: Callable[[], bool], stream: bool
    ) -> Readiness | None:
        """Before a slot that is not the member's last is computed into the pass's
        buffer. With rounds (``each``) and ``stream``, the slot's round starts on the comm
        thread (behind the previous one) and the returned readiness follows its backward:
        each bucket is rounded and reduce-scattered as the backward finishes it, and the
        backward is held to the round's window (it may not overwrite what the previous
        round still reads). Else None: the slot is computed whole, then given to :meth:`add`."""
        if self.rounds is None:
            return None
        self._comm = (comm, timeout, abort)
        if not stream:
            return None
        ready = Readiness(abort)
        ready.allow(0)  # until its round starts: the previous round may still read
        self._submit(self._like, ready)
        self._streaming = True
        return ready

    def add(self, buf: torch.Tensor) -> None:
        """One finished slot (not the member's last): peaks merged, integers added; with
        rounds, its round (under way already if :meth:`begin_slot` streamed it, else run
        now and waited for)."""
        if self.rounds is None:
            for i in self._buckets:
                self._add_bucket(buf, i)
        elif not self._streaming:
            self._wait(self._submit(buf, None))
        self._streaming = False
        self.added += 1

    def skip(self, comm: Any, *, timeout: timedelta, abort: Callable[[], bool]) -> None:
        """A padding pass of this member (``train.shard_params``: a throwaway slot that
        keeps its group's gathers in step): with rounds, a round of zeros now, so that
        the group's rounds stay in step with its passes; else nothing."""
        if self.rounds is not None:
            self._comm = (comm, timeout, abort)
            self._wait(self._submit(None, None))

    def _wait(self, fut: Future[None]) -> None:
        assert self._comm is not None, "begin_slot() first"
        self._comm[0].result(fut)

    def _submit(self, buf: torch.Tensor | None, ready: Readiness | None) -> Future[None]:
        """One round on the comm thread: of ``buf`` (final unless ``ready`` follows it as
        its backward fills it), or of zeros (None). A round after one that failed fails
        alike, so that the pass's result raises what the first one did."""
        assert self._comm is not None, "begin_slot() first"
        comm, timeout, abort = self._comm

        def wait(upto: int, tick: Callable[[], None]) -> None:
            if ready is not None:
                ready.wait(upto, lambda: _ticked(tick, abort), timeout.total_seconds())

        def run() -> None:
            try:
                if self._error is not None:
                    raise self._error
                self._run_round(comm.pg, buf, wait, timeout, ready)
            except BaseException as e:
                self._error = e
                raise
            finally:
                if ready is not None:
                    ready.close()

        return cast("Future[None]", comm.submit(run))

    def _run_round(
        self,
        pg: Any,
        buf: torch.Tensor | None,
        wait: Callable[[int, Callable[[], None]], None],
        timeout: timedelta,
        window: Readiness | None,
    ) -> None:
        """One slot's buckets (``buf``; None: zeros) rounded as ``wait`` says they are
        final and reduce-scattered in the group, each bucket's sum of this rank's range
        folded into the rounds' accumulator and its pages dropped once settled; the
        backward (``window``) may write one bucket past the one on the wire."""
        rounds, sc = self.rounds, self.scatter
        assert rounds is not None and sc is not None
        ex = ScatterExchange(sc, self.ints, pg, None, fold=rounds.fold)
        buckets = self._buckets
        if window is not None:
            window.allow(self.exact._values(self.n, 0)[1] if self.aliased else math.inf)
        for i in buckets:
            lo, hi = self.exact._values(self.n, i)
            wait(hi, _idle)
            self._add_bucket(buf, i)
            ex.send(lo, hi)
            if window is not None and self.aliased:
                ex.settle(1, timeout)
                nxt = i + 1 if i + 1 < len(buckets) else None
                window.allow(math.inf if nxt is None else self.exact._values(self.n, nxt)[1])
        ex.settle(0, timeout)
        rounds.end_round(self.ints)

    def finish(
        self,
        comm: Any,
        out: torch.Tensor,
        *,
        timeout: timedelta,
        last: torch.Tensor | None = None,
        ready: Readiness | None = None,
        abort: Callable[[], bool] = lambda: False,
        send_delay_s: float = 0.0,
    ) -> Future[tuple[torch.Tensor | None, torch.Tensor]]:
        """On the comm thread: every member's sum into ``out`` (None for a measuring pass)
        and the step's true block maxima (the step takes the verdict: :meth:`accepts`).
        ``last``: the member's last slot, read bucket by bucket as ``ready`` says its backward has
        finished it (None for ``ready``: final already), each bucket on the wire at once;
        ``out`` may be ``last``: it is written once every bucket is sent."""
        tiers = getattr(comm, "tiers", None)
        pg = comm.pg if self.size > 1 else None
        t = timeout.total_seconds()
        self._phase = "finishing"
        window = ready if self._scatters(pg, tiers) and self.aliased else None
        if self.rounds is not None and ready is not None:  # its round sets it once it starts
            window = ready
            window.allow(0)
        elif window is not None:  # set before the backward writes: its first bucket only
            window.allow(self.exact._values(self.n, 0)[1])

        def wait(upto: int, tick: Callable[[], None]) -> None:
            """Until ``[0, upto)`` is final, ``tick`` (the buckets in flight advance) every
            few milliseconds meanwhile."""
            if ready is not None:
                ready.wait(upto, lambda: _ticked(tick, abort), t)

        def run() -> tuple[torch.Tensor | None, torch.Tensor]:
            try:
                return self._finish(pg, tiers, out, last, wait, timeout, send_delay_s, window)
            finally:
                if ready is not None:
                    ready.close()

        return comm.submit(run)

    def _scatters(self, pg: Any, tiers: Tiers | None) -> bool:
        """Whether this pass reduce-scatters its buckets in the replica group."""
        sc = self.scatter
        return (
            pg is not None
            and tiers is None
            and self.summing
            and sc is not None
            and (self.n == sc.size)
        )

    # -- the passes ------------------------------------------------------------------------

    @property
    def _buckets(self) -> range:
        return range(len(_bucket_ranges(self.n, self.block)))

    def _add_bucket(self, buf: torch.Tensor | None, i: int) -> None:
        """Bucket ``i`` of ``buf``: its non-finite values zeroed (the slot's flag is set
        already), its block peaks merged, its integers added (set by the first slot;
        zeros for a member that adds no slot at all)."""
        lo, hi = self.exact._values(self.n, i)
        if buf is None:  # a member without a slot, or a round of zeros
            if self.added == 0 or self.rounds is not None:
                self.ints[lo:hi].zero_()
            return
        part = buf[lo:hi]
        blo, bhi = _bucket_ranges(self.n, self.block)[i]
        peaks = self.peaks[blo:bhi]
        fused = self.exact._fused([part])
        if fused is not None:
            mine = torch.empty_like(peaks)
            if fused.peaks([part], self.block, mine):
                _zero_non_finite([part])
                fused.peaks([part], self.block, mine)
        else:
            _zero_non_finite([part])
            rows, _ = self.exact._span(buf, i)
            mine = rows.abs().amax(dim=1).view(torch.int32)
        torch.maximum(peaks, mine, out=peaks)
        if not self.summing:
            return
        over = torch.nonzero(maxima_of(mine) > self.exps[blo:bhi]).flatten()
        for j in over.tolist():  # kept as floats for the outlier lane, zero in the integers
            a, b = lo + j * self.block, min(hi, lo + (j + 1) * self.block)
            self.outliers.keep(blo + j, buf[a:b])
            buf[a:b] = 0.0
        add = self.added > 0 and self.rounds is None  # a round holds one slot
        if fused is not None:
            fused.accumulate(self.ints, [buf], self.scale, (lo, hi), self.block, add=add)
            return
        acc_rows, (a, b) = self.exact._span(self.ints, i)
        rows, _ = self.exact._span(buf, i)
        ints = (rows * self.scale[a:b, None]).round_().to(self.ints.dtype)
        if add:
            acc_rows += ints
        else:
            acc_rows.copy_(ints)

    def _finish(
        self,
        pg: Any,
        tiers: Tiers | None,
        out: torch.Tensor,
        last: torch.Tensor | None,
        wait: Callable[[int, Callable[[], None]], None],
        timeout: timedelta,
        send_delay_s: float,
        window: Readiness | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """``window``: the backward's, where the integers live in its buffer and each
        bucket's other shards' pages are dropped once sent (``comm/scatter.py``): it may
        write one bucket past the one on the wire."""
        if pg is not None and send_delay_s > 0:
            time.sleep(send_delay_s)  # injected link latency (the delay fault)
        if self.rounds is not None:
            return self._finish_rounds(pg, out, last, wait, timeout, window)
        sc = self.scatter
        streams = pg is not None and tiers is None and self.summing
        ex = ScatterExchange(sc, self.ints, pg, None) if sc and self._scatters(pg, tiers) else None
        flagged = torch.empty(self.peaks.numel() + 1, dtype=torch.int32)
        tiered = None
        if pg is not None and tiers is not None:  # the buckets, then the maxima and the flag
            sums = [(self.exact._flat(self.ints, i), dist.ReduceOp.SUM) for i in self._buckets]
            parts = (sums if self.summing else []) + [(flagged, dist.ReduceOp.MAX)]
            tiered = TieredBuckets(tiers, parts, timeout)
        tick = tiered.poll if tiered is not None else _idle
        pending = []
        buckets = self._buckets
        wire = self._wire(last) if streams and ex is None and tiered is None else None
        for i in buckets:
            wait(self.exact._values(self.n, i)[1], tick)
            self._add_bucket(last, i)
            if tiered is not None and self.summing:  # its region's all-reduce now
                tiered.add()
            if ex is not None:
                ex.send(*self.exact._values(self.n, i))
                if window is not None:
                    ex.settle(1, timeout)
                    nxt = i + 1 if i + 1 < len(buckets) else None
                    window.allow(math.inf if nxt is None else self.exact._values(self.n, nxt)[1])
            elif streams:  # on the wire while the backward finishes the next bucket
                flat = self.exact._flat(self.ints, i)
                if wire is not None:  # from a copy: the member's own sum stays whole
                    flat = self.exact._flat(wire, i).copy_(flat)
                pending.append(pg.allreduce([flat]))
        if wire is not None:  # the sums land in the wire copy, converted from there
            self.own, self.ints, self._phase = self.ints, wire, "sent"
        flagged[:-1] = maxima_of(self.peaks)
        flagged[-1] = int(self.outliers.full)
        if tiered is not None:  # the maxima beside the last bucket
            tiered.add()
            tiered.finish()
        elif pg is not None:
            self._max(pg, tiers, flagged, timeout)
        maxima, capped = flagged[:-1], bool(flagged[-1])
        for work in pending:
            work.wait(timeout)
        if not self.summing:
            return None, maxima
        spans = ex.finish(timeout) if ex is not None else [(0, self.n)]
        done = self._complete(pg, tiers, out, maxima, capped, spans, timeout)
        if wire is not None and self.own is not None:  # the accumulator, for the next pass
            self.ints, self.own, self._phase = self.own, None, "done"
        return done

    def _wire(self, last: torch.Tensor | None) -> torch.Tensor | None:
        """Where a pass's all-reduce runs from, so that its own integers survive a
        reduction that fails (salvage: :meth:`partial`): the last slot's buffer, as int32
        (each bucket of it is added into the integers before it is overwritten, and the
        sum is converted back into it); None where it cannot hold them (64-bit integers,
        a buffer of another shape, or the integers already in it: :attr:`aliased`)."""
        if last is None or self.aliased or self.bits != 32:
            return None
        ok = last.dtype == torch.float32 and last.is_contiguous() and last.numel() == self.n
        return last.view(torch.int32) if ok and last.device == self.ints.device else None

    def _finish_rounds(
        self,
        pg: Any,
        out: torch.Tensor,
        last: torch.Tensor | None,
        wait: Callable[[int, Callable[[], None]], None],
        timeout: timedelta,
        window: Readiness | None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """With rounds (``each``): the last slot's round (behind its backward), the rounds
        of zeros this member owes its group, the MAX of the block maxima, then the
        accumulated range across groups and the tail over every member, converted."""
        rounds, sc = self.rounds, self.scatter
        assert rounds is not None and sc is not None
        if self._error is not None:  # an earlier round failed: the pass fails with it
            raise self._error
        if last is not None:
            self._run_round(pg, last, wait, timeout, window)
        while rounds.left > 0:
            self._run_round(pg, None, lambda upto, tick: None, timeout, None)
        flagged = torch.empty(self.peaks.numel() + 1, dtype=torch.int32)
        flagged[:-1] = maxima_of(self.peaks)
        flagged[-1] = int(self.outliers.full)
        self._max(pg, None, flagged, timeout)
        maxima, capped = flagged[:-1], bool(flagged[-1])
        rounds.put_back(self.ints)
        buckets = [self.exact._values(self.n, i) for i in self._buckets]
        spans = ScatterExchange(sc, self.ints, pg, None).crossed(buckets, timeout)
        return self._complete(pg, None, out, maxima, capped, spans, timeout)

    def _complete(
        self,
        pg: Any,
        tiers: Tiers | None,
        out: torch.Tensor,
        maxima: torch.Tensor,
        capped: bool,
        spans: Iterable[tuple[int, int]],
        timeout: timedelta,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The summed integers of ``spans`` converted into ``out`` as each lands, and the
        blocks above their exponents through the outlier lane (None: ``capped``)."""
        over = torch.nonzero(maxima > self.exps).flatten()
        mains = None if capped else self._no_mains(over)
        back = self.exact._fused([out])
        for lo, hi in spans:  # each span once its sum is in (a scatter's: as they land)
            if mains is not None:  # the outlier blocks' main integers, before an in-place
                self._take_mains(mains, lo, hi)  # conversion overwrites them
            self._convert(out, lo, hi, back)
        if mains is None:
            return None, maxima
        if over.numel():
            self._outlier_lane(pg, tiers, over, maxima, [m for _, m in mains], out, timeout)
        return out, maxima

    def _no_mains(self, over: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """Room for the summed integers of the blocks ``over``, as int64 (zeros), each
        with the block's first value's index: the block ranges are taken once a step."""
        out = []
        for j in over.tolist():
            a, b = j * self.block, min(self.n, (j + 1) * self.block)
            out.append((a, torch.zeros(b - a, dtype=torch.int64)))
        return out

    def _take_mains(self, mains: list[tuple[int, torch.Tensor]], lo: int, hi: int) -> None:
        """The parts inside ``[lo, hi)`` of the outlier blocks' summed integers: taken
        span by span as each span's sum lands, never before (a reduce-scatter's spans are
        summed as :meth:`ScatterExchange.finish` yields them; read earlier, a block held
        a partial sum that depended on the exchange's timing). Outside the spans a
        block's values are another shard's, dead here."""
        for a, main in mains:
            x, y = max(a, lo), min(a + main.numel(), hi)
            if x < y:
                main[x - a : y - a] = self.ints[x:y]

    def _convert(self, out: torch.Tensor, lo: int, hi: int, back: Any) -> None:
        """The sums of ``[lo, hi)`` into ``out``, exactly those values: the block-aligned
        conversion also converts the head of ``lo``'s block, which, where the integers
        live in ``out`` (:attr:`aliased`), may be another span's values converted
        already; so a head that starts inside a block is converted by itself."""
        head = min(hi, -(-lo // self.block) * self.block) if self.aliased else lo
        if head > lo:
            j = lo // self.block
            torch.mul(self.ints[lo:head].to(torch.float32), self.inv[j], out=out[lo:head])
        if hi > head:
            self.exact._convert_values(self.ints, self.inv, out, head, hi, back)

    def _outlier_lane(
        self,
        pg: Any,
        tiers: Tiers | None,
        over: torch.Tensor,
        maxima: torch.Tensor,
        mains: list[torch.Tensor],
        out: torch.Tensor,
        timeout: timedelta,
    ) -> None:
        """The blocks whose maximum exceeded the exponent they were rounded against: every
        member sums its kept slot blocks of them as integers of the reduction's width
        against the block's true maximum (the ``step`` form's rounding: one all-reduce of
        ``len(over) * block`` values), and the block's result is that sum plus the main
        integers already summed for it (every slot that stayed below its exponent), on the
        finer of the two grids where an int64 holds both (32-bit: always but for a block
        that grew more than 32 bits), else on the lane's (the main sum floored onto it),
        converted once."""
        k = self.exact._shift(self.exps[over])
        k_out = self.exact._shift(maxima[over])
        lane = self.outliers.lane(over, k_out, self.ints.dtype)
        if pg is not None and tiers is not None:
            tiered_allreduce(tiers, lane, dist.ReduceOp.SUM, timeout)
        elif pg is not None:
            pg.allreduce([lane]).wait(timeout)
        wide = self.bits == 32
        for row, j in enumerate(over.tolist()):
            a, b = j * self.block, min(self.n, (j + 1) * self.block)
            main, part = mains[row], lane[row, : b - a].to(torch.int64)
            d = int(k[row] - k_out[row])  # >= 0: the prediction's grid is the finer
            if wide and d <= 32:
                total, grid = (part << d) + main, int(k[row])
            else:
                total, grid = part + (main >> min(d, 63)), int(k_out[row])
            out[a:b] = total.to(torch.float32) * 2.0**-grid

    @staticmethod
    def _max(pg: Any, tiers: Tiers | None, maxima: torch.Tensor, timeout: timedelta) -> None:
        """``maxima`` (in place) = the block maxima over every member."""
        if tiers is not None:
            tiered_allreduce(tiers, maxima, dist.ReduceOp.MAX, timeout)
            return
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
        pg.allreduce([maxima], opts).wait(timeout)
