"""Which writer writes which bytes: a deterministic split of the tensors into W parts.

Every writer holds an identical replica, so each computes the same plan from the tensors'
names, dtypes and shapes alone, with no communication. The tensors are laid end to end
in their fixed order and the byte stream is cut near ``k * total / W``; a tensor that
straddles a cut is split along its first dimension at the nearest row boundary. A tensor
with fewer than two rows (0-d, empty, one row) is never split, so parts are balanced only
to within one row or one small tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

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


def plan_parts(metas: list[Meta], world: int) -> list[list[Chunk]]:
    """The chunks of each rank, in file order; their union covers every tensor exactly."""
    if world < 1:
        raise ValueError(f"world must be >= 1 (got {world})")
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
