"""The exact reduction with carried exponents: one accumulator whatever the slot count, and
one exchange a step (``train.reduction_exponents = "carried"``).

The ``step`` form (``exact.py``) must know every block's exponent before it converts a
single value, so a rank keeps every slot's float buffer until the last slot of the step is
done (slots x P), and a MAX round precedes the integer sum. Here the exponents are
*predicted*, *verified* and, when the prediction was wrong, the step is computed again, as
dynamic loss scaling does for fp16:

- **Predict.** Each bucket of the buffer (``exact._bucket_ranges``: up to ``CHUNK`` values
  of whole blocks) gets one exponent: the previous step's true maximum in that bucket plus
  ``MARGIN`` bits (a bucket that was all zeros: the buffer's maximum plus the margin). The
  prediction is state of the run: it travels in checkpoints and state copies
  (``Trainer.exponents``).
- **Accumulate as slots finish.** Each slot is rounded against the prediction and added to
  one int64 accumulator the moment its backward is done; its float buffer then takes the
  next slot (the last one is added bucket by bucket while the earlier buckets are on the
  wire), and the sum is converted back into it. Scratch: the accumulator (8 bytes a value),
  whatever the slot count.
- **Verify, in the same exchange.** The step's true maximum of each bucket over every slot
  of every rank is what the verdict and the next prediction need. A MAX is not a SUM, but
  a one-hot histogram is: each rank adds a 1 at its own maximum's bin (``BINS``: every
  float32 exponent and one for zero), the histograms travel summed at the end of the
  integer buffer, and the highest bin with a count is the maximum over the ranks, exact
  in any order. So a step costs one exchange (the tiers' included), where the ``step``
  form pays two. The sum stands when no bucket's maximum exceeds its prediction (no
  integer can then overflow: the ``step`` form's headroom argument) and no prediction is
  more than ``SLACK`` bits above its bucket's maximum (every accepted value keeps at least
  ``62 - headroom - SLACK`` bits below it: 50 with 16 slots).
- **Fall back.** Otherwise every member computes the step's slots again, rounded against
  the true bucket maxima, which cannot fail. A run's first step (nothing carried yet)
  takes its maxima from a pass that only measures.

Every decision is a function of the slot gradients and of the previous step's maxima,
themselves a function of the trajectory: whoever computed which slot, every rank accepts
or falls back identically and the result is the same bits. It is a different rounding from
the ``step`` form's (per bucket, not per block), so it is a math setting.

In replica groups (``train.shard_reduce``) the integers are reduce-scattered as in the
``step`` form (``comm/scatter.py``) while the histograms go whole, so that every rank
takes the same verdict: with sharded state a rank then keeps one slot buffer, the
accumulator and its own range of the sum.

Limits: 64-bit integers only (32 leave too few bits for a per-bucket exponent); a step
whose prediction misses costs a second compute pass (the first step always does); and a
member's finished slots are not salvaged across a membership change (they are inside
its accumulator).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from perdure.runtime.comm.exact import ExactReducer, _bucket_ranges, _zero_non_finite
from perdure.runtime.comm.readiness import Readiness
from perdure.runtime.comm.scatter import Scatter, ScatterExchange
from perdure.runtime.comm.tiers import Tiers, tiered_allreduce

MARGIN = 2
"""Bits a bucket's prediction sits above the previous step's largest exponent: a gradient
may grow 4x from one step to the next before its step is computed twice."""
SLACK = 8
"""Bits a prediction may sit above the step's true maximum and still be accepted: a
gradient may shrink 64x (below the margin) before its step is computed twice."""
ZERO = -(1 << 20)
"""The true exponent of a block whose values are all zero (below every real one)."""


# -- the pure part: predictions and their verdict ------------------------------------------

E_LO, E_HI = -148, 128
"""The ``frexp`` exponents of finite nonzero float32 values (2**-149 has -148)."""
BINS = E_HI - E_LO + 2
"""Histogram bins per bucket: one for an all-zero bucket, then one per exponent."""


def bucket_maxima(peaks: torch.Tensor, n: int, block: int) -> list[int]:
    """Each bucket's true exponent (the smallest ``e`` with ``|g| < 2**e`` for all its
    values) from its blocks' peaks (the bits of each block's largest ``|g|``, int32
    storage, finite), ``ZERO`` for a bucket whose values are all zero."""
    out = []
    for lo, hi in _bucket_ranges(n, block):
        top = int(peaks[lo:hi].max()) if hi > lo else 0
        value = torch.tensor([top], dtype=torch.int32).view(torch.float32)
        out.append(ZERO if top == 0 else int(torch.frexp(value)[1][0]))
    return out


def histogram(maxima: Sequence[int], out: torch.Tensor) -> None:
    """``out`` (``len(maxima) * BINS`` int64) = one 1 per bucket, at its maximum's bin."""
    out.zero_()
    for b, e in enumerate(maxima):
        out[b * BINS + (0 if e == ZERO else e - E_LO + 1)] = 1


def from_histogram(summed: torch.Tensor) -> list[int]:
    """Each bucket's maximum over every rank: its highest bin with a count."""
    out = []
    for row in summed.view(-1, BINS):
        hit = torch.nonzero(row[1:]).flatten()
        out.append(ZERO if hit.numel() == 0 else int(hit[-1]) + E_LO)
    return out


def fitted(maxima: Sequence[int]) -> list[int]:
    """The exponents a missed step is computed again with: the maxima themselves (an
    all-zero bucket takes the buffer's maximum)."""
    top = max((m for m in maxima if m != ZERO), default=0)
    return [top if m == ZERO else m for m in maxima]


def predict(maxima: Sequence[int]) -> list[int]:
    """The next step's exponent of each bucket, from this step's maxima (the module
    doc): ``MARGIN`` bits above the fitted ones."""
    return [e + MARGIN for e in fitted(maxima)]


def accepts(used: Sequence[int], maxima: Sequence[int]) -> bool:
    """Whether a sum rounded against ``used`` stands: no bucket above its exponent, none
    more than ``SLACK`` bits below it (an all-zero bucket loses nothing)."""
    return all(m == ZERO or m <= u <= m + SLACK for u, m in zip(used, maxima, strict=True))


def expand(per_bucket: Sequence[int], n: int, block: int) -> torch.Tensor:
    """A bucket's exponent repeated over its blocks."""
    ranges = _bucket_ranges(n, block)
    if len(per_bucket) != len(ranges):
        raise ValueError(
            f"carried exponents: {len(per_bucket)} buckets for a buffer of {len(ranges)}"
        )
    counts = torch.tensor([hi - lo for lo, hi in ranges])
    return torch.repeat_interleave(torch.tensor(list(per_bucket), dtype=torch.int32), counts)


# -- one member's side ---------------------------------------------------------------------


class CarriedReducer:
    """Adds a member's slots into one accumulator as they finish, then sums every member's
    accumulator and bucket histogram in one exchange (the module doc). Reductions of whole
    buffers (the re-runs' flags) go through the ``step`` form, ``start``."""

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
        block: int,
        fused: bool = True,
        scatter: Scatter | None = None,
    ):
        """``scatter``: a replica group's reduce-scatter (``comm/scatter.py``) of the
        slot buffer's sum; the sum is then final on this rank's range and the tail only
        (the maxima stay whole: every rank takes the same verdict)."""
        self.exact = ExactReducer(rank, size, slots=slots, bits=64, block=block, fused=fused)
        self.size, self.block, self.scatter = size, block, scatter
        self.start = self.exact.start
        self.n, self.added, self.summing = 0, 0, False
        self.peaks = torch.zeros(0, dtype=torch.int32)
        self.acc = torch.zeros(0, dtype=torch.int64)
        """The epoch's scratch: ``n`` integers, then ``BINS`` histogram counts a bucket."""

    def open(
        self,
        like: torch.Tensor,
        used: Sequence[int] | torch.Tensor | None,
        *,
        adds: int = 1,
        rounds: int = 0,
        resume: Any = None,
    ) -> bool:
        """Begin a pass over one step's slots, rounded against ``used`` (an exponent per
        bucket, or per block), or None for a pass that only measures the maxima. ``adds``
        and ``rounds``: unused (the 64-bit accumulator and its histograms never fit the
        float buffer; every slot is added locally and the sum reduced once). ``resume``:
        never taken (False): this form keeps no partial sum (:meth:`partial`)."""
        n = like.numel()
        buckets = len(_bucket_ranges(n, self.block))
        self.n, self.added, self.summing = n, 0, used is not None
        self.peaks = torch.zeros(-(-n // self.block), dtype=torch.int32)
        if self.acc.numel() != n + buckets * BINS:
            self.acc = torch.empty(n + buckets * BINS, dtype=torch.int64, device=like.device)
        self.ints, self.hist = self.acc[:n], self.acc[n:]
        if used is None:
            return False
        blocks = used if isinstance(used, torch.Tensor) else expand(used, n, self.block)
        k = self.exact._shift(blocks)
        self.scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
        self.inv = torch.ldexp(torch.ones_like(k, dtype=torch.float32), -k)
        return False

    def partial(self) -> None:
        """No salvage here: a refused prediction computes the pass again, and its
        histograms would have to be kept with the sum (the streamed form's is built)."""
        return None

    # the carried state's rules, for the step (pure: the module's functions)

    def used(self, pred: list[int]) -> list[int]:
        return pred

    def accepts(self, pred: list[int], maxima: list[int]) -> bool:
        return accepts(pred, maxima)

    def fitted(self, maxima: list[int]) -> list[int]:
        return fitted(maxima)

    def predict(self, pred: list[int] | None, maxima: list[int]) -> list[int]:
        return predict(maxima)

    def begin_slot(
        self, comm: Any, *, timeout: timedelta, abort: Callable[[], bool], stream: bool
    ) -> None:
        """Nothing: each slot is computed whole and given to :meth:`add`."""

    def skip(self, comm: Any, *, timeout: timedelta, abort: Callable[[], bool]) -> None:
        """Nothing: a padding pass adds nothing to the local accumulator."""

    def add(self, buf: torch.Tensor) -> None:
        """One finished slot: its non-finite values zeroed (its flag is set already), its
        block peaks merged, and its integers added to the accumulator."""
        self._merge_peaks(buf)
        if not self.summing:
            return
        fused = self.exact._fused([buf])
        for i in self._buckets:
            self._accumulate(buf, i, fused)
        self.added += 1

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
    ) -> Future[tuple[torch.Tensor | None, list[int]]]:
        """On the comm thread: every member's sum into ``out`` (None for a measuring pass)
        and the step's true maximum of each bucket. ``last``: a slot not ``add``-ed yet,
        added here bucket by bucket, each bucket's integers on the wire while the next is
        converted (``out`` may be the same buffer: it is written once all are sent).
        ``ready``: follows ``last`` while its backward fills it; this form waits for the
        whole of it (the histogram needs every bucket's maximum first)."""
        tiers = getattr(comm, "tiers", None)
        pg = comm.pg if self.size > 1 else None

        def run() -> tuple[torch.Tensor | None, list[int]]:
            if ready is not None and last is not None:
                ready.wait(last.numel(), abort, timeout.total_seconds())
            return self._finish(pg, tiers, out, last, timeout, send_delay_s)

        return comm.submit(run)

    # -- the passes ------------------------------------------------------------------------

    @property
    def _buckets(self) -> range:
        return range(len(_bucket_ranges(self.n, self.block)))

    def _merge_peaks(self, buf: torch.Tensor) -> None:
        """The slot's block peaks into the step's (its non-finite values zeroed first)."""
        fused = self.exact._fused([buf])
        if fused is not None:
            mine = torch.empty_like(self.peaks)
            if fused.peaks([buf], self.block, mine):
                _zero_non_finite([buf])
                fused.peaks([buf], self.block, mine)
            torch.maximum(self.peaks, mine, out=self.peaks)
            return
        _zero_non_finite([buf])
        for i in self._buckets:
            rows, (lo, hi) = self.exact._span(buf, i)
            mine = rows.abs().amax(dim=1).view(torch.int32)
            torch.maximum(self.peaks[lo:hi], mine, out=self.peaks[lo:hi])

    def _accumulate(self, buf: torch.Tensor, i: int, fused: Any) -> None:
        """Bucket ``i`` of the integers += ``buf``'s (= for the first slot)."""
        add = self.added > 0
        if fused is not None:
            span = self.exact._values(self.n, i)
            fused.accumulate(self.ints, [buf], self.scale, span, self.block, add=add)
            return
        acc_rows, (lo, hi) = self.exact._span(self.ints, i)
        rows, _ = self.exact._span(buf, i)
        ints = (rows * self.scale[lo:hi, None]).round_().to(torch.int64)
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
        timeout: timedelta,
        send_delay_s: float,
    ) -> tuple[torch.Tensor | None, list[int]]:
        if last is not None:
            self._merge_peaks(last)
        histogram(bucket_maxima(self.peaks, self.n, self.block), self.hist)
        if pg is not None and send_delay_s > 0:
            time.sleep(send_delay_s)  # injected link latency (the delay fault)
        fused = None if last is None else self.exact._fused([last])
        sc = self.scatter
        if pg is not None and sc is not None and self.n == sc.size and self.summing:
            return self._scattered(sc, pg, tiers, out, last, fused, timeout)
        if pg is not None and tiers is not None:  # one exchange for all of it
            for i in self._buckets if self.summing else ():
                self._add_bucket(last, i, fused)
            whole = self.acc if self.summing else self.hist
            tiered_allreduce(tiers, whole, dist.ReduceOp.SUM, timeout)
            return self._back(out), from_histogram(self.hist)
        pending = [] if pg is None else [pg.allreduce([self.hist])]
        for i in self._buckets if self.summing else ():
            self._add_bucket(last, i, fused)
            if pg is not None:  # on the wire while the next bucket is converted
                pending.append(pg.allreduce([self.exact._flat(self.ints, i)]))
        for work in pending:
            work.wait(timeout)
        return self._back(out), from_histogram(self.hist)

    def _scattered(
        self,
        sc: Scatter,
        pg: Any,
        tiers: Tiers | None,
        out: torch.Tensor,
        last: torch.Tensor | None,
        fused: Any,
        timeout: timedelta,
    ) -> tuple[torch.Tensor | None, list[int]]:
        """``_finish`` in a replica group: the histograms all-reduced whole beside the
        integers' reduce-scatter, and only this rank's range and the tail converted back
        (``out`` may be ``last``: every bucket of it is added before any is converted)."""
        hist = None if tiers is not None else pg.allreduce([self.hist])
        ex = ScatterExchange(sc, self.ints, pg, tiers)
        for i in self._buckets:
            self._add_bucket(last, i, fused)
            ex.send(*self.exact._values(self.n, i))
        back = self.exact._fused([out])
        for lo, hi in ex.finish(timeout):
            self.exact._convert_values(self.ints, self.inv, out, lo, hi, back)
        if hist is not None:
            hist.wait(timeout)
        else:
            tiered_allreduce(tiers, self.hist, dist.ReduceOp.SUM, timeout)  # type: ignore[arg-type]
        return out, from_histogram(self.hist)

    def _add_bucket(self, last: torch.Tensor | None, i: int, fused: Any) -> None:
        """Bucket ``i`` of the integers made final: ``last``'s added (zeros for a member
        that added no slot at all)."""
        if last is not None:
            self._accumulate(last, i, fused)
        elif self.added == 0:
            self.exact._flat(self.ints, i).zero_()

    def _back(self, out: torch.Tensor) -> torch.Tensor | None:
        if not self.summing:
            return None
        fused = self.exact._fused([out])
        for i in self._buckets:
            self.exact._convert_back(self.ints, self.inv, out, i, fused)
        return out
