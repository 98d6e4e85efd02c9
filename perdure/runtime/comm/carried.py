"""The exact reduction with carried exponents: one accumulator whatever the slot count, and
no exponent round in front of the sum (``train.reduction_exponents = "carried"``).

The ``step`` form (``exact.py``) must know every block's exponent before it converts a
single value, so a rank keeps every slot's float buffer until the last slot of the step is
done (slots x P) and pays a MAX round before the integer sum. Here the exponents are
*predicted*, *verified* and, when the prediction was wrong, the step is computed again, as
dynamic loss scaling does for fp16:

- **Predict.** Each bucket of the buffer (``exact._bucket_ranges``: up to ``CHUNK`` values
  of whole blocks) gets one exponent, the previous step's largest true block exponent in
  that bucket plus ``MARGIN`` bits (a bucket that was all zeros: the buffer's largest plus
  the margin). The prediction is state of the run: it travels in checkpoints and state
  copies (``Trainer.exponents``).
- **Accumulate as slots finish.** Each slot is rounded against the prediction and added to
  one int64 accumulator the moment its backward is done; its float buffer then takes the
  next slot, and at the end the sum converted back. Scratch: the accumulator (8 bytes a
  value) and the block peaks, whatever the slot count.
- **Verify.** The step's true block exponents (a MAX over every slot of every rank: exact in
  any order) are all-reduced alongside the integer sum, not before it. The sum is accepted
  when no value exceeded its bucket's prediction (no integer can then overflow, as in the
  ``step`` form's headroom argument) and no bucket's prediction is more than ``SLACK``
  bits above its true maximum (so every accepted value keeps at least
  ``62 - headroom - SLACK`` bits below its bucket's maximum: 50 with 16 slots).
- **Fall back.** Otherwise the slots are computed again and rounded against the true
  per-block exponents, which cannot fail: the same sum the ``step`` form gives. A run's
  first step (nothing carried yet) takes its exponents from a pass that only measures.

Every decision is a function of the slot gradients and of the previous step's exponents,
which are themselves a function of the trajectory: whoever computed which slot, every
rank accepts or falls back identically and the result is the same bits. It is a different
rounding from the ``step`` form's (per bucket, not per block), so it is a math setting.

Limits: 64-bit integers only (32 leave too few bits for a per-bucket exponent); a step
whose prediction misses costs a second compute pass (the first step always does); the
last slot is added after its backward, not streamed behind it; and a member's finished
slots are not salvaged across a membership change (they are inside the accumulator).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from perdure.runtime.comm.exact import ExactReducer, _bucket_ranges, _zero_non_finite
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


def true_exponents(peaks: torch.Tensor) -> torch.Tensor:
    """Per block, the smallest ``e`` with ``|g| < 2**e`` from its peak (the bits of its
    largest ``|g|``, int32 storage; finite), ``ZERO`` for an all-zero block."""
    e = torch.frexp(peaks.view(torch.float32))[1].to(torch.int32)
    return torch.where(peaks == 0, torch.tensor(ZERO, dtype=torch.int32), e)


def predict(true: torch.Tensor, n: int, block: int) -> list[int]:
    """The next step's exponent of each bucket of an ``n``-value buffer, from this step's
    true block exponents (see the module doc)."""
    top = int(true.max()) if true.numel() else ZERO
    fallback = (top if top != ZERO else 0) + MARGIN
    out = []
    for lo, hi in _bucket_ranges(n, block):
        m = int(true[lo:hi].max())
        out.append(fallback if m == ZERO else m + MARGIN)
    return out


def expand(per_bucket: Sequence[int], n: int, block: int) -> torch.Tensor:
    """A bucket's exponent repeated over its blocks."""
    ranges = _bucket_ranges(n, block)
    if len(per_bucket) != len(ranges):
        raise ValueError(
            f"carried exponents: {len(per_bucket)} buckets for a buffer of {len(ranges)}"
        )
    counts = torch.tensor([hi - lo for lo, hi in ranges])
    return torch.repeat_interleave(torch.tensor(list(per_bucket), dtype=torch.int32), counts)


def accepts(used: torch.Tensor, true: torch.Tensor, n: int, block: int) -> bool:
    """Whether a sum rounded against ``used`` (per block) stands: no block above it, and
    no bucket with values more than ``SLACK`` bits below it."""
    if bool((true > used).any()):
        return False
    for lo, hi in _bucket_ranges(n, block):
        m = int(true[lo:hi].max())
        if m != ZERO and int(used[lo:hi].max()) - m > SLACK:
            return False
    return True


# -- one member's side ---------------------------------------------------------------------


class CarriedReducer:
    """Adds a member's slots into one accumulator as they finish, then sums every member's
    accumulator (the module doc). Reductions of whole buffers (the re-runs' flags) go
    through the ``step`` form, ``start``."""

    streaming = True

    def __init__(self, rank: int, size: int, *, slots: int, block: int, fused: bool = True):
        self.exact = ExactReducer(rank, size, slots=slots, bits=64, block=block, fused=fused)
        self.size, self.block = size, block
        self.start = self.exact.start
        self.used: torch.Tensor | None = None
        self.peaks = torch.zeros(0, dtype=torch.int32)
        self.added = 0
        self.acc = torch.zeros(0, dtype=torch.int64)

    def open(self, like: torch.Tensor, used: torch.Tensor | None) -> None:
        """Begin a pass over one step's slots: ``used`` the per-block exponents to round
        against, or None for a pass that only measures them."""
        n = like.numel()
        self.n, self.used, self.added = n, used, 0
        self.peaks = torch.zeros(-(-n // self.block), dtype=torch.int32)
        if used is not None:
            k = self.exact._shift(used)
            self.scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
            self.inv = torch.ldexp(torch.ones_like(k, dtype=torch.float32), -k)
            if self.acc.numel() != n:  # scratch for the epoch: a step's accumulator
                self.acc = torch.empty(n, dtype=torch.int64, device=like.device)

    def add(self, buf: torch.Tensor) -> None:
        """One finished slot: its non-finite values zeroed (its flag is set already), its
        block peaks merged, and its integers added to the accumulator."""
        mine = self._peaks(buf)
        torch.maximum(self.peaks, mine, out=self.peaks)
        if self.used is None:
            return
        fused = self.exact._fused([buf])
        for i in range(len(_bucket_ranges(self.n, self.block))):
            self._accumulate(buf, i, fused)
        self.added += 1

    def finish(
        self,
        comm: Any,
        out: torch.Tensor,
        *,
        timeout: timedelta,
        send_delay_s: float = 0.0,
    ) -> Future[tuple[torch.Tensor | None, torch.Tensor]]:
        """On the comm thread: every member's sum into ``out`` (None for a measuring pass)
        and the step's true block exponents."""
        tiers = getattr(comm, "tiers", None)
        pg = comm.pg if self.size > 1 else None
        return comm.submit(lambda: self._finish(pg, tiers, out, timeout, send_delay_s))

    # -- the passes ------------------------------------------------------------------------

    def _peaks(self, buf: torch.Tensor) -> torch.Tensor:
        peaks = torch.zeros_like(self.peaks)
        fused = self.exact._fused([buf])
        if fused is not None and not fused.peaks([buf], self.block, peaks):
            return peaks
        _zero_non_finite([buf])
        if fused is not None:
            fused.peaks([buf], self.block, peaks)
            return peaks
        for i in range(len(_bucket_ranges(self.n, self.block))):
            rows, (lo, hi) = self.exact._span(buf, i)
            peaks[lo:hi] = rows.abs().amax(dim=1).view(torch.int32)
        return peaks

    def _accumulate(self, buf: torch.Tensor, i: int, fused: Any) -> None:
        add = self.added > 0
        if fused is not None:
            span = self.exact._values(self.n, i)
            fused.accumulate(self.acc, [buf], self.scale, span, self.block, add=add)
            return
        acc_rows, (lo, hi) = self.exact._span(self.acc, i)
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
        timeout: timedelta,
        send_delay_s: float,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        true = true_exponents(self.peaks)
        if self.used is not None and self.added == 0:
            self.acc.zero_()  # a member without slots adds nothing
        if pg is not None and send_delay_s > 0:
            time.sleep(send_delay_s)  # injected link latency (the delay fault)
        if pg is not None and tiers is not None:
            tiered_allreduce(tiers, true, dist.ReduceOp.MAX, timeout)
            if self.used is not None:
                tiered_allreduce(tiers, self.acc, dist.ReduceOp.SUM, timeout)
            return self._back(out), true
        pending = []
        if pg is not None:  # the exponents in flight with the sum, not in front of it
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
            pending.append(pg.allreduce([true], opts))
            if self.used is not None:
                pending += [pg.allreduce([self.exact._flat(self.acc, i)]) for i in self._buckets]
        for work in pending:
            work.wait(timeout)
        return self._back(out), true

    @property
    def _buckets(self) -> range:
        return range(len(_bucket_ranges(self.n, self.block)))

    def _back(self, out: torch.Tensor) -> torch.Tensor | None:
        if self.used is None:
            return None
        fused = self.exact._fused([out])
        for i in self._buckets:
            self.exact._convert_back(self.acc, self.inv, out, i, fused)
        return out


def headroom_bits(slots: int) -> int:
    """Bits every accepted value keeps below its bucket's maximum (the module doc)."""
    return 62 - (math.ceil(math.log2(slots)) if slots > 1 else 0) - SLACK
