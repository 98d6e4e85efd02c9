"""CRC-32 of a file computed in blocks, on threads, from the memory being written or read.

The checksum is plain CRC-32 (zlib, IEEE 802.3) of the whole file, so a reader needs only
``zlib.crc32``. ``zlib.crc32`` releases the GIL on large buffers, so blocks can be summed
on a thread while the writer writes the next one; per-block CRCs are joined with the
standard GF(2) shift (``crc32_combine``), so the result does not depend on the block size.
Measured here at about 2.4 GB/s per core, against about 1 GB/s for a write plus fsync.
"""

from __future__ import annotations

import functools
import zlib
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ThreadPoolExecutor

BLOCK = 64 << 20
"""File-aligned block size for threaded checksums and bounded reads and writes."""

_POLY = 0xEDB88320

_POOL: ThreadPoolExecutor | None = None


def checksum_pool() -> ThreadPoolExecutor:
    """Threads that sum CRC blocks while the caller reads or writes the next one (one
    pool for the process: the writer and the loader share it)."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="perdure-crc")
    return _POOL


def _times(mat: Sequence[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: Sequence[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def _shift_slow(crc: int, length: int) -> int:
    """The CRC register after ``length`` zero bytes (zlib's crc32_combine, crc2 = 0)."""
    if length == 0:
        return crc
    odd = [_POLY] + [1 << n for n in range(31)]
    even = _square(odd)
    odd = _square(even)
    while True:
        even = _square(odd)
        if length & 1:
            crc = _times(even, crc)
        length >>= 1
        if not length:
            return crc
        odd = _square(even)
        if length & 1:
            crc = _times(odd, crc)
        length >>= 1
        if not length:
            return crc


@functools.lru_cache(maxsize=8)
def _shift_matrix(length: int) -> tuple[int, ...]:
    return tuple(_shift_slow(1 << i, length) for i in range(32))


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``."""
    if len2 == BLOCK:
        return _times(_shift_matrix(BLOCK), crc1) ^ crc2
    return _shift_slow(crc1, len2) ^ crc2


def blocks(segments: Iterable[memoryview], size: int = BLOCK) -> Iterator[list[memoryview]]:
    """Cut a file given as consecutive byte segments into file-aligned blocks of ``size``
    bytes (the last may be shorter); each block is a list of memoryview slices."""
    block: list[memoryview] = []
    room = size
    for seg in segments:
        seg = seg.cast("B") if seg.format != "B" or seg.ndim != 1 else seg
        while len(seg):
            take = seg[:room]
            block.append(take)
            seg = seg[len(take) :]
            room -= len(take)
            if room == 0:
                yield block
                block, room = [], size
    if block:
        yield block


def crc_block(block: Sequence[memoryview]) -> tuple[int, int]:
    """(CRC-32, length) of one block."""
    crc = 0
    for mv in block:
        crc = zlib.crc32(mv, crc)
    return crc, sum(len(mv) for mv in block)


def join(parts: Iterable[tuple[int, int]]) -> int:
    """CRC-32 of the concatenation of blocks given as (crc, length) in file order."""
    crc = 0
    for c, n in parts:
        crc = crc32_combine(crc, c, n)
    return crc


def join_futures(futures: Iterable[Future[tuple[int, int]]]) -> int:
    return join(f.result() for f in futures)


def crc_segments(segments: Iterable[memoryview], pool: Executor | None = None) -> int:
    """CRC-32 of consecutive segments, blocks summed on ``pool`` when one is given."""
    if pool is None:
        return join(crc_block(b) for b in blocks(segments))
    return join_futures([pool.submit(crc_block, b) for b in blocks(segments)])


def format_crc(crc: int) -> str:
    """How a CRC appears in the manifest: 8 lower-case hex digits."""
    return f"{crc:08x}"
