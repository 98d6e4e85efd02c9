"""int8 DiLoCo's outer reduction (``outer.precision = "int8"``): an all-gather of the
replicas' int8 pseudo-gradients, summed by every member in replica order.

The exact reduction carries integers of ``train.reduction_bits`` (4 or 8 bytes a value);
an int8 pseudo-gradient through it would cost fp32's bytes. Here each member puts its
hosted replicas on the wire as *records* of one replica each::

    [replica index: int32 | its tail: (2 + M) float32 | exponents: int8 per block | P int8]

(the tail: its non-finite flag, its mean inner loss and its M task metrics, the slot
buffer's entries that only that replica sets). One all-gather over the epoch's members
brings every record to every member; gloo's all-gather needs equal sizes, so each member
sends as many records as the plan gives its busiest member (every member knows the plan,
so no count is exchanged first), the unused ones with index -1. Every member then decodes
the R pseudo-gradients (``int8 x 2**(e - 7)``, exact in float64) and adds them in replica
index order in float64: the same inputs in the same order, so the same bits on every
member whichever member hosted which replica, then rounds the sum to float32. The tails
are placed, not summed (one replica sets each entry). So a reduced buffer is a pure
function of the R replicas, as the exact reduction's is.

With ``outer.error_feedback`` (EF21) a record holds the int8 rounding of the replica's
pseudo-gradient less its estimate ``g_r`` (``OuterStep.estimates``, which every member
holds for all R replicas); every member decodes each record, adds it to its copy of
``g_r`` (float64, rounded to float32) and sums the R new estimates in replica order. The
new estimates come back with the buffer and become current with the outer step's update:
the same records, the same bits on every member, so a replica's estimate does not depend
on who computed it, and a replica that moves needs nothing copied.

Bytes: a member sends ``width`` records and receives ``(W - 1) x width`` (gloo's ring
all-gather). With ``outer.wire_compression = "zlib"`` a member's records travel
compressed (zlib level 1; lossless, so every member decodes the same bytes it would have
received raw): an all-gather of the compressed sizes first (8 bytes a member), then one of
the compressed payloads padded to the largest; a payload that does not inflate to exactly
the records' size is refused (an error of the outer step, never a larger allocation).
A record is ``P + ceil(P / block) + 4 (3 + M)`` bytes: a quarter of what the
exact reduction sends of one slot buffer with ``train.reduction_bits = 32`` (``4 (P + (2 +
M) S)`` bytes of integers and 4 per block of maxima), plus ``4 + 4 (2 + M) - (2 + M) S``.
Across regions, with one worker per region (the synchronous step's tiers then exchange
every leader's whole buffer with every other leader: ``(W - 1)`` buffers into each
region), a region receives ``(W - 1)`` records where the synchronous step receives
``(W - 1)`` integer buffers: a quarter of its bytes per step, for H steps' tokens. Limits:
the all-gather is flat over the members, not in the tiers of
``cluster.hierarchical_reduce`` (a region with k members receives every record k times,
where the tiers' region receives each buffer once), a member hosting fewer replicas than
the busiest sends unused records (gloo's all-gather takes equal sizes; compressed, they
cost next to nothing), and the gather
starts once the last replica is done (nothing overlaps it).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch

from perdure.runtime.replica.layout import GradLayout
from perdure.runtime.replica.outer import decode_int8, ef21_encode, ef21_update, encode_int8

_INDEX = 4
"""Bytes of a record's replica index (int32; -1: an unused record)."""
ZLIB_LEVEL = 1
"""zlib's fastest level: within 2 % of level 6's size on int8 pseudo-gradients, at a
third of its time."""


class Int8Gather:
    """Records of one epoch's layout: packing, the all-gather and the replica-order sum."""

    def __init__(self, layout: GradLayout, block: int, *, compress: bool = False) -> None:
        if layout.moves:
            raise ValueError(
                f"outer.precision = 'int8' needs a model whose forward moves no buffers "
                f"(got {layout.moves} buffer values): a record carries the pseudo-gradient "
                "and the tail only"
            )
        self.layout, self.block, self.compress = layout, block, compress
        self.blocks = -(-layout.numel // block)
        self.tail = 2 + layout.metrics
        """Tail entries of one replica: its flag, its loss and its M metrics."""

    @property
    def record_bytes(self) -> int:
        """One replica's record: index, tail, exponents and values."""
        return _INDEX + 4 * self.tail + self.blocks + self.layout.numel

    def payload_bytes(self, width: int) -> int:
        """What one member sends per outer step: ``width`` records."""
        return width * self.record_bytes

    # -- records ---------------------------------------------------------------------------

    def _tail_of(self, buf: torch.Tensor, slot: int) -> torch.Tensor:
        lay = self.layout
        parts = [lay.flags(buf)[slot : slot + 1], lay.losses(buf)[slot : slot + 1]]
        return torch.cat([*parts, lay.user_metrics(buf)[:, slot]]).float().cpu()

    def pack(
        self,
        slots: Sequence[int],
        bufs: Sequence[torch.Tensor],
        width: int,
        estimates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This member's records (``slots[i]``'s pseudo-gradient in ``bufs[i]``), padded
        with unused ones to ``width``: a uint8 tensor of ``payload_bytes(width)``.
        ``estimates`` (``outer.error_feedback``, [R, P]): a record holds its replica's
        pseudo-gradient less its estimate (:func:`ef21_encode`)."""
        if len(slots) > width:
            raise ValueError(f"{len(slots)} replicas do not fit in {width} records")
        out = torch.zeros(self.payload_bytes(width), dtype=torch.uint8)
        recs = out.view(width, self.record_bytes)
        recs[:, :_INDEX] = torch.tensor([-1], dtype=torch.int32).view(torch.uint8)
        for rec, slot, buf in zip(recs[: len(slots)], slots, bufs, strict=True):
            grads = self.layout.grads(buf)
            if estimates is None:
                q, exp = encode_int8(grads, self.block)
            else:
                q, exp = ef21_encode(grads, estimates[slot], self.block)
            a = _INDEX + 4 * self.tail
            b = a + self.blocks
            rec[:_INDEX] = torch.tensor([slot], dtype=torch.int32).view(torch.uint8)
            rec[_INDEX:a] = self._tail_of(buf, slot).view(torch.uint8)
            rec[a:b] = exp.view(torch.uint8)
            rec[b:] = q.view(torch.uint8)
        return out

    def total(
        self,
        gathered: Sequence[torch.Tensor],
        replicas: int,
        estimates: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The reduced slot buffer from every member's payload: the R pseudo-gradients
        decoded and added in replica order (float64, then float32), the tails placed.
        With ``estimates`` (``outer.error_feedback``) each record is a difference: the
        replica's new estimate is its old one plus the decoded record (:func:`ef21_update`)
        and the buffer holds the new estimates' sum; returned with the buffer (else None).
        Raises if a replica is missing or sent twice (a plan that members disagree on)."""
        lay, found = self.layout, {}
        for payload in gathered:
            for rec in payload.cpu().view(-1, self.record_bytes):
                r = int(rec[:_INDEX].clone().view(torch.int32))
                if r < 0:
                    continue
                if r in found or r >= replicas:
                    raise RuntimeError(
                        f"int8 gather: replica {r} sent twice or out of [0, {replicas}): the "
                        "members disagree on the plan (a bug)"
                    )
                found[r] = rec
        if sorted(found) != list(range(replicas)):
            raise RuntimeError(
                f"int8 gather: replicas {sorted(set(range(replicas)) - set(found))} missing: "
                "the members disagree on the plan (a bug)"
            )
        total = lay.new_buffer()
        acc = torch.zeros(lay.numel, dtype=torch.float64)
        a = _INDEX + 4 * self.tail
        b = a + self.blocks
        new = None if estimates is None else torch.empty_like(estimates)
        for r in range(replicas):
            rec = found[r]
            exp = rec[a:b].clone().view(torch.int8)
            q = rec[b:].clone().view(torch.int8)
            if estimates is None or new is None:
                acc += decode_int8(q, exp, self.block)
            else:
                new[r] = ef21_update(estimates[r], q, exp, self.block)
                acc += new[r].double()
            tail = rec[_INDEX:a].clone().view(torch.float32).to(total.device)
            lay.flags(total)[r], lay.losses(total)[r] = tail[0], tail[1]
            lay.user_metrics(total)[:, r] = tail[2:]
        lay.grads(total).copy_(acc.to(torch.float32))
        return total, new

    # -- the exchange ----------------------------------------------------------------------

    def start(
        self,
        comm: Any,
        slots: Sequence[int],
        bufs: Sequence[torch.Tensor],
        width: int,
        timeout: timedelta,
        send_delay_s: float = 0.0,
        estimates: torch.Tensor | None = None,
    ) -> Any:
        """Start the all-gather of this member's records on ``comm``'s thread; its result
        (``comm.result``) is :meth:`total`'s (the reduced buffer, the new estimates).
        ``width``: the records of the plan's busiest member; ``send_delay_s``: an injected
        link latency; ``estimates``: the replicas' (``outer.error_feedback``)."""
        mine = self.pack(slots, bufs, width, estimates)  # on the CPU, where zlib works
        replicas = self.layout.slots

        def run() -> tuple[torch.Tensor, torch.Tensor | None]:
            if send_delay_s:
                time.sleep(send_delay_s)
            outs = [mine]
            if comm.size > 1 and self.compress:
                outs = gather_compressed(comm, mine, timeout)
            elif comm.size > 1:
                wire = mine.to(comm.device)
                outs = [torch.empty_like(wire) for _ in range(comm.size)]
                comm.pg.allgather([outs], [wire]).wait(timeout)
            return self.total(outs, replicas, estimates)

        return comm.submit(run)


# -- the compressed wire (outer.wire_compression) -------------------------------------------


def compress(raw: torch.Tensor) -> torch.Tensor:
    """``raw`` (uint8, on the CPU) deflated at :data:`ZLIB_LEVEL`."""
    packed = zlib.compress(raw.numpy().tobytes(), ZLIB_LEVEL)
    return torch.frombuffer(bytearray(packed), dtype=torch.uint8)


def inflate(packed: torch.Tensor, nbytes: int, rank: int) -> torch.Tensor:
    """What member ``rank`` compressed, checked to inflate to exactly ``nbytes`` (the
    records' size every member knows from the plan); raises otherwise, without inflating
    more than ``nbytes + 1`` bytes whatever the payload says."""
    d = zlib.decompressobj()
    try:
        raw = d.decompress(packed.cpu().numpy().tobytes(), nbytes + 1)
    except zlib.error as e:
        raise RuntimeError(f"int8 gather: member {rank}'s records do not inflate: {e}") from None
    if len(raw) > nbytes:
        why = f"inflate to more than the plan's {nbytes} bytes"
    elif len(raw) < nbytes or not d.eof:
        why = f"inflate to {len(raw)} bytes, not the plan's {nbytes}"
    elif d.unused_data or d.unconsumed_tail:
        why = "carry trailing bytes"
    else:
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    raise RuntimeError(f"int8 gather: member {rank}'s records {why}")


def gather_compressed(comm: Any, raw: torch.Tensor, timeout: timedelta) -> list[torch.Tensor]:
    """Every member's ``raw`` (each the same size), travelling deflated: the sizes
    all-gathered first, then the payloads padded to the largest."""
    packed = compress(raw)
    mine = torch.tensor([packed.numel()], dtype=torch.int64, device=comm.device)
    sizes = [torch.empty_like(mine) for _ in range(comm.size)]
    comm.pg.allgather([sizes], [mine]).wait(timeout)
    counts = [int(n) for n in sizes]
    bound = raw.numel() + raw.numel() // 100 + 1024  # deflate's worst case is far below
    for rank, n in enumerate(counts):
        if not 0 < n <= bound:
            raise RuntimeError(f"int8 gather: member {rank} announced {n} compressed bytes")
    padded = torch.zeros(max(counts), dtype=torch.uint8, device=comm.device)
    padded[: packed.numel()] = packed.to(comm.device)
    outs = [torch.empty_like(padded) for _ in range(comm.size)]
    comm.pg.allgather([outs], [padded]).wait(timeout)
    pairs = enumerate(zip(outs, counts, strict=True))
    return [inflate(o[:n], raw.numel(), r) for r, (o, n) in pairs]
