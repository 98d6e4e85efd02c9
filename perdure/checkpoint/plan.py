"""Which writer writes which bytes: a deterministic split of the tensors into W parts.

Every writer holds an identical replica, so each computes the same plan from the tensors'
names, dtypes and shapes alone, with no communication. The tensors are laid end to end
in their fixed order and the byte stream is cut near ``k * total / W``; a tensor that
straddles a cut is split along its first dimension at the nearest row boundary. A tensor
with fewer than two rows (0-d, empty, one row) is never split, so parts are balanced only
to within one row or one small tensor.

A sharded state (``train.shard_degree``) is not identical on every writer: a tensor of one
shard's optimizer state lives only on the ranks that own that shard. ``holders`` names
those ranks per tensor. The tensors of one set of holders are laid end to end and cut
among those holders alone, as above (at most one tensor per cut is split, so a loader maps
the others whole), and the rest is cut among all writers. Every writer still computes the
same plan: the holders are a pure function of the shard ownership, which every rank knows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from perdure.checkpoint.tensors import Meta


@dataclass(frozen=True)
class Chunk:
    """Rows ``[start, stop)`` of tensor ``meta.key``, stored under ``file_key`` by ``rank``.
    For a 0-d tensor, ``start == stop == 0`` and ``whole`` is true."""

    meta: Meta
    rank: int
    start: int
    stop: int
    whole: bool

    @property
    def file_key(self) -> str:
        return self.meta.key if self.whole else f"{self.meta.key}[{self.start}:{self.stop}]"

    @property
    def shape(self) -> tuple[int, ...]:
        if not self.meta.shape:
            return ()
        return (self.stop - self.start, *self.meta.shape[1:])

    @property
    def byte_range(self) -> tuple[int, int]:
        """Byte range of this chunk within the whole tensor's bytes."""
        if not self.meta.shape:
            return 0, self.meta.nbytes
        rb = self.meta.row_bytes
        return self.start * rb, self.stop * rb


def plan_parts(
    metas: list[Meta], world: int, holders: Mapping[str, Sequence[int]] | None = None
) -> list[list[Chunk]]:
    """The chunks of each rank, in file order; their union covers every tensor exactly.
    ``holders``: for a tensor that not every rank holds, the ranks that do."""
    if world < 1:
        raise ValueError(f"world must be >= 1 (got {world})")
    holders = holders or {}
    _check_holders(holders, world)
    parts = _cut([m for m in metas if m.key not in holders], world)
    by_holders: dict[tuple[int, ...], list[Meta]] = {}
    for m in metas:
        if m.key in holders:
            by_holders.setdefault(tuple(sorted(set(holders[m.key]))), []).append(m)
    for ranks, held in by_holders.items():
        for i, chunks in enumerate(_cut(held, len(ranks))):
            parts[ranks[i]] += [replace(c, rank=ranks[i]) for c in chunks]
    return parts


def _check_holders(holders: Mapping[str, Sequence[int]], world: int) -> None:
    for key, ranks in holders.items():
        if not ranks or any(not 0 <= r < world for r in ranks):
            raise ValueError(
                f"{key}: its holders must be a non-empty list of ranks in [0, {world}) "
                f"(got {list(ranks)})"
            )


def _cut(metas: list[Meta], world: int) -> list[list[Chunk]]:
    """Every tensor of ``metas`` laid end to end and cut into ``world`` near-equal parts."""
    total = sum(m.nbytes for m in metas)
    bounds = [total * (k + 1) // world for k in range(world)]
    parts: list[list[Chunk]] = [[] for _ in range(world)]
    rank, pos = 0, 0
    for m in metas:
        rows = m.shape[0] if m.shape else 0
        start = 0
        while True:
            while rank < world - 1 and pos >= bounds[rank]:
                rank += 1
            left = m.nbytes - start * m.row_bytes
            splittable = len(m.shape) > 0 and rows - start > 1 and m.row_bytes > 0
            if rank == world - 1 or pos + left <= bounds[rank] or not splittable:
                stop = rows if m.shape else 0
                parts[rank].append(Chunk(m, rank, start, stop, whole=start == 0))
                pos += left
                break
            k = round((bounds[rank] - pos) / m.row_bytes)
            if k >= rows - start:
                parts[rank].append(Chunk(m, rank, start, rows, whole=start == 0))
                pos += left
                break
            if k > 0:
                parts[rank].append(Chunk(m, rank, start, start + k, whole=False))
                pos += k * m.row_bytes
                start += k
            rank += 1
    return parts
