"""The exact reduction: slot gradients summed as integers, so order and placement cannot
change a bit.

Integer addition is associative. The flat buffer is cut into blocks of ``block`` values;
each block gets one exponent ``e``, the smallest with ``|g| < 2**e`` for every value of the
block in every slot (a MAX all-reduce of exponents: exact in any order). Each slot's value
is then scaled by ``2**k`` with ``k = bits - 2 - headroom - e`` (``headroom`` =
``ceil(log2 S)`` bits, so the sum of S slots cannot overflow) and rounded to an integer
(half to even): a pure function of the value and ``e``. The integers are added in any
order, on any number of ranks, by the backend's own ``all_reduce``, and the sum is
converted back once (``2**-k``, then one rounding to float32). The result is a pure
function of the slot gradients, whoever computed which slot.

Accuracy: every slot value is kept to ``bits - 2 - headroom`` bits below its block's
maximum (int64 with 16 slots: 58 bits, far below float32's 24; int32: 26 bits, which
loses relative precision on values much smaller than their block's maximum). Non-finite
values are zeroed before conversion: their slot's flag (already set by the slot engine,
and a finite 1.0) makes every replica redo the step, so they never reach an update.

The integers travel in buckets of ``CHUNK`` values: gloo's own threads all-reduce bucket
``i`` while this thread converts bucket ``i + 1``, so conversion overlaps communication.

In replica groups (``train.shard_reduce``) the integers are reduce-scattered instead
(``comm/scatter.py``): a rank converts back its shard's range of the sum only.

The conversions run in fused C kernels (:mod:`perdure.runtime.comm.exact_kernels`: one
pass each for the exponents, the integers and the way back) when they build and agree with
the torch ops on a probe; the torch ops below stay as the fallback and the reference, and
give the same bits.

Limits of this first version: the step's exponents are known only once every slot of
every rank is done, so a rank keeps its float slot buffers until then (slots x P, as the
chain does) and the reduction starts after its last slot's backward instead of streaming
behind it (with the kernels, the peaks of a rank's other slots are taken while that
backward runs; the last slot's pass waits for it).
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from perdure.runtime.comm import exact_kernels
from perdure.runtime.comm.exact_kernels import Kernels
from perdure.runtime.comm.scatter import Scatter, ScatterExchange
from perdure.runtime.comm.tiers import Tiers, tiered_allreduce
from perdure.runtime.replica.slots import all_finite

CHUNK = 1 << 20
"""Values converted at a time (bounds the float64 temporaries)."""

Peaks = tuple[torch.Tensor, bool]
"""Block peaks of some slots (the bits of each block's largest ``|g|``, int32 storage) and
whether one of them is not finite."""


class ExactReducer:
    """One member's side of the exact reduction (see the module doc). ``fused``: use the
    fused kernels where they are available (False: the torch ops, the reference).
    ``scatter``: a replica group's reduce-scatter (``comm/scatter.py``) for the slot
    buffers; the sum is then final on this rank's shard range and the buffer's tail only."""

    carried = False

    @property
    def scatters(self) -> bool:
        return self.scatter is not None

    """One buffer per slot, summed by :meth:`start` (no carried state)."""

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
    ) -> None:
        assert bits in (32, 64) and block > 0 and slots > 0
        self.rank, self.size, self.bits, self.block = rank, size, bits, block
        self.scatter = scatter
        self.headroom = math.ceil(math.log2(slots)) if slots > 1 else 0
        self.dtype = torch.int64 if bits == 64 else torch.int32
        self.scratch: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.kernels = fused_kernels() if fused else None

    def start(
        self,
        comm: Any,
        bufs: Sequence[torch.Tensor],
        *,
        timeout: timedelta,
        ready: Any = None,
        abort: Callable[[], bool] = lambda: False,
        send_delay_s: float = 0.0,
    ) -> Future[torch.Tensor]:
        n = bufs[0].numel()
        t = timeout.total_seconds()

        tiers = getattr(comm, "tiers", None)

        def run() -> torch.Tensor:
            early = None
            if ready is not None:  # the other slots are final: their peaks, during its backward
                early = self._early_peaks(bufs)
                ready.wait(n, abort, t)
            pg = comm.pg if self.size > 1 else None
            return self.reduce(pg, bufs, timeout, send_delay_s, tiers=tiers, early=early)

        return comm.submit(run)

    def reduce(
        self,
        pg: Any,
        bufs: Sequence[torch.Tensor],
        timeout: timedelta,
        send_delay_s: float = 0.0,
        *,
        tiers: Tiers | None = None,
        early: Peaks | None = None,
    ) -> torch.Tensor:
        """The exact sum of every member's ``bufs`` (all final); ``pg`` None: one member.
        With ``tiers``, every all-reduce goes inside regions first, then across. ``early``:
        :meth:`_early_peaks` of these ``bufs``, taken before the last one was final."""
        fused = self._fused(bufs)
        exps = self._finite_exponents(bufs, fused, early)
        if pg is not None:
            _delay(send_delay_s)
        if pg is not None and tiers is not None:
            tiered_allreduce(tiers, exps, dist.ReduceOp.MAX, timeout)
        elif pg is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX  # type: ignore[assignment]
            pg.allreduce([exps], opts).wait(timeout)
        k = self._shift(exps)
        acc, out = self._buffers(bufs[0])
        scale = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k)
        inv = torch.ldexp(torch.ones_like(k, dtype=torch.float32), -k)
        buckets = range(len(self._ranges(acc.numel())))
        sc = self.scatter
        if pg is not None and sc is not None and acc.numel() == sc.size:
            ex = ScatterExchange(sc, acc, pg, tiers)
            for i in buckets:  # gloo's threads scatter this bucket while we convert the next
                self._accumulate(acc, bufs, scale, i, fused)
                ex.send(*self._values(acc.numel(), i))
            for lo, hi in ex.finish(timeout):
                self._convert_values(acc, inv, out, lo, hi, fused)
            return out
        if pg is not None and tiers is not None:
            # One exchange for the whole buffer: across regions each exchange costs round
            # trips, and buckets would pay them one after another.
            for i in buckets:
                self._accumulate(acc, bufs, scale, i, fused)
            tiered_allreduce(tiers, acc, dist.ReduceOp.SUM, timeout)
            for i in buckets:
                self._convert_back(acc, inv, out, i, fused)
            return out
        pending: list[tuple[Any, int]] = []
        for i in buckets:
            self._accumulate(acc, bufs, scale, i, fused)
            if pg is not None:  # gloo's threads reduce this bucket while we convert the next
                pending.append((pg.allreduce([self._flat(acc, i)]), i))
            else:
                self._convert_back(acc, inv, out, i, fused)
        for work, i in pending:
            work.wait(timeout)
            self._convert_back(acc, inv, out, i, fused)
        return out

    # -- the steps -------------------------------------------------------------------------

    def _fused(self, bufs: Sequence[torch.Tensor]) -> Kernels | None:
        """The kernels, if there are any and ``bufs`` are what they take (contiguous CPU
        float32 of one length); else None: the torch ops."""
        if self.kernels is None or not bufs:
            return None
        n = bufs[0].numel()
        plain = all(
            b.dtype == torch.float32 and b.device.type == "cpu" and b.is_contiguous() for b in bufs
        )
        return self.kernels if plain and all(b.numel() == n for b in bufs) else None

    def _early_peaks(self, bufs: Sequence[torch.Tensor]) -> Peaks | None:
        """The block peaks of every slot but the last (the one whose backward may still be
        running), so that only the last slot's pass waits for it; None where the kernels
        are not used (the torch path takes every slot after the last is final)."""
        if len(bufs) < 2 or self._fused(bufs) is None:
            return None
        assert self.kernels is not None
        peaks = torch.empty(-(-bufs[0].numel() // self.block), dtype=torch.int32)
        return peaks, self.kernels.peaks(bufs[:-1], self.block, peaks)

    def _finite_exponents(
        self, bufs: Sequence[torch.Tensor], fused: Kernels | None, early: Peaks | None = None
    ) -> torch.Tensor:
        """Zero the non-finite values of ``bufs`` (in place), then their exponents. The
        kernel finds a non-finite value in the same pass as the peaks, so the common,
        finite case reads the buffers once (``early``: the last one, the others before)."""
        if fused is None:
            _zero_non_finite(bufs)
            return self._exponents(bufs)
        if early is not None:
            peaks, bad = early
            bad = fused.peaks(bufs[-1:], self.block, peaks, merge=True) or bad
        else:
            peaks = torch.empty(-(-bufs[0].numel() // self.block), dtype=torch.int32)
            bad = fused.peaks(bufs, self.block, peaks)
        if bad:
            _zero_non_finite(bufs)
            fused.peaks(bufs, self.block, peaks)
        exps = torch.empty_like(peaks)
        fused.exponents(peaks, exps)
        return exps

    def _exponents(self, bufs: Sequence[torch.Tensor]) -> torch.Tensor:
        """Per block, the smallest ``e`` with ``|g| < 2**e`` over this rank's slots."""
        n = bufs[0].numel()
        peak = torch.zeros(-(-n // self.block), dtype=bufs[0].dtype, device=bufs[0].device)
        for b in bufs:
            for i in range(len(self._ranges(n))):
                rows, (lo, hi) = self._span(b, i)
                torch.maximum(peak[lo:hi], rows.abs().amax(dim=1), out=peak[lo:hi])
        return torch.frexp(peak)[1].to(torch.int32)

    def _shift(self, exps: torch.Tensor) -> torch.Tensor:
        """Per block, the power of two ``k`` that scales it to integer range. Capped at 126
        so that ``2**k`` is a float32: a block whose every value is below 2**-68 (int64)
        keeps an absolute quantum of 2**-126 instead of its full relative precision."""
        return ((self.bits - 2 - self.headroom) - exps).clamp_(max=126)

    def _accumulate(
        self,
        acc: torch.Tensor,
        bufs: Sequence[torch.Tensor],
        scale: torch.Tensor,
        i: int,
        fused: Kernels | None = None,
    ) -> None:
        """Bucket ``i`` of ``acc`` = the sum over this rank's slots of ``round(b * 2**k)``.
        In float32 the product is exact (a power-of-two scaling) and so is the rounding:
        below 2**23 a float32 holds every integer and half-integer step, and above it the
        value is an integer already."""
        if fused is not None:
            fused.accumulate(acc, bufs, scale, self._values(acc.numel(), i), self.block)
            return
        acc_rows, (lo, hi) = self._span(acc, i)
        acc_rows.zero_()
        for b in bufs:
            rows, _ = self._span(b, i)
            acc_rows += (rows * scale[lo:hi, None]).round_().to(self.dtype)

    def _convert_back(
        self,
        acc: torch.Tensor,
        inv: torch.Tensor,
        out: torch.Tensor,
        i: int,
        fused: Kernels | None = None,
    ) -> None:
        """Bucket ``i`` of ``out = float32(acc) * 2**-k``: one rounding of the integer sum to
        float32, then an exact power-of-two scaling (``k`` is capped at 126, so ``2**-k`` is
        a normal float32; a product in the subnormal range rounds once more, as a fixed
        function of the sum)."""
        if fused is not None:
            fused.back(out, acc, inv, self._values(acc.numel(), i), self.block)
            return
        rows, (lo, hi) = self._span(acc, i)
        out_rows, _ = self._span(out, i)
        torch.mul(rows.to(torch.float32), inv[lo:hi, None], out=out_rows)

    def _convert_values(
        self,
        acc: torch.Tensor,
        inv: torch.Tensor,
        out: torch.Tensor,
        lo: int,
        hi: int,
        fused: Kernels | None = None,
    ) -> None:
        """``_convert_back`` for the values ``[lo, hi)``, from the start of ``lo``'s block
        (the values before ``lo`` in it are converted too, and unused), at most ``CHUNK``
        values at a time."""
        step = max(self.block, CHUNK // self.block * self.block)
        for a in range(lo - lo % self.block, hi, step):
            b = min(hi, a + step)
            if fused is not None:
                fused.back(out, acc, inv, (a, b), self.block)
                continue
            blocks = torch.arange(a, b, device=acc.device) // self.block
            torch.mul(acc[a:b].to(torch.float32), inv[blocks], out=out[a:b])

    # -- blocks ----------------------------------------------------------------------------

    def _ranges(self, n: int) -> tuple[tuple[int, int], ...]:
        return _bucket_ranges(n, self.block)

    def _values(self, n: int, i: int) -> tuple[int, int]:
        """Bucket ``i`` as a range of values."""
        lo, hi = self._ranges(n)[i]
        return lo * self.block, min(n, hi * self.block)

    def _flat(self, x: torch.Tensor, i: int) -> torch.Tensor:
        lo, hi = self._values(x.numel(), i)
        return x[lo:hi]

    def _span(self, x: torch.Tensor, i: int) -> tuple[torch.Tensor, tuple[int, int]]:
        """Bucket ``i`` of ``x`` as a ``[blocks, block]`` view (the partial block: one row
        of its own width), with its block range."""
        lo, hi = self._ranges(x.numel())[i]
        flat = self._flat(x, i)
        return flat.view(hi - lo, -1), (lo, hi)

    def _buffers(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = like.numel()
        if n not in self.scratch:
            acc = torch.empty(n, dtype=self.dtype, device=like.device)
            self.scratch[n] = (acc, torch.empty_like(like))
        return self.scratch[n]


@functools.lru_cache(maxsize=64)
def _bucket_ranges(n: int, block: int) -> tuple[tuple[int, int], ...]:
    """Buckets of whole blocks, at most ``CHUNK`` values each, as block ranges; the last,
    partial block is a bucket of its own. Cached: every step asks for the same ``n``."""
    full, per = n // block, max(1, CHUNK // block)
    out = [(lo, min(full, lo + per)) for lo in range(0, full, per)]
    return tuple(out + ([(full, full + 1)] if n % block else []))


def _zero_non_finite(bufs: Sequence[torch.Tensor]) -> None:
    for b in bufs:
        if not all_finite(b):
            torch.nan_to_num_(b, nan=0.0, posinf=0.0, neginf=0.0)


@functools.cache
def fused_kernels() -> Kernels | None:
    """The fused kernels if they load and give the torch ops' bits on a probe (heavy tails,
    subnormals, zeros, huge values, a partial block, both widths); else None, with one log
    line. Once per process: the probe costs a few milliseconds."""
    kernels = exact_kernels.load()
    if kernels is None:
        return None
    if not all(_agrees(kernels, bits) for bits in (32, 64)):
        exact_kernels.log.warning(
            "exact reduction: the fused kernels in %s disagree with the torch ops on a "
            "probe; using the torch path",
            kernels.path,
        )
        return None
    return kernels


def _agrees(kernels: Kernels, bits: int) -> bool:
    g = torch.Generator().manual_seed(bits)
    n = 3 * 64 + 17  # three blocks and a partial one
    bufs = [torch.randn(n, generator=g) * torch.exp(8 * torch.randn(n, generator=g)) for _ in "abc"]
    bufs[0][:40] = torch.tensor([0.0, -0.0, 1e-45, -3e-42, 1e-38, 3e38, -3e38, 0.5, 1.5, -2.5] * 4)
    reducer = ExactReducer(0, 1, slots=len(bufs), bits=bits, block=64, fused=False)
    want = reducer.reduce(None, [b.clone() for b in bufs], timedelta(seconds=5)).clone()
    reducer.kernels = kernels
    return torch.equal(reducer.reduce(None, bufs, timedelta(seconds=5)), want)


def _delay(delay_s: float) -> None:
    if delay_s > 0:
        time.sleep(delay_s)  # injected link latency (the delay fault), before the exchange
