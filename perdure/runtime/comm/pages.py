"""Handing a buffer's pages back to the kernel while the buffer lives on.

A replica group's rank needs the reduced gradient of its own shard only; the rest of its
slot buffer is input to the reduce-scatter and dead once a bucket's exchange is done. A
tensor cannot be freed in part, but its memory can: ``madvise(MADV_DONTNEED)`` drops the
pages of a range (the resident set shrinks at once), and the next write to the range maps
fresh zero pages. So a rank's gradient side stays near ``P / k`` plus the buckets in
flight (``comm/scatter.py``), FSDP2's bound, with one flat buffer whose views the rest of
the step keeps using.

Limits: Linux only (elsewhere, and for device memory, :func:`release` does nothing and
says so by returning 0); only whole pages inside the range are dropped (a range's
partial first and last pages stay); the next step's writes into the range pay a page
fault per page (a zero-filled 4 KiB page: about 1-2 % of the copy of the gradient they
receive, measured in docs/performance.md); memory that is shared or locked is left
resident (the call fails and is ignored).
"""

from __future__ import annotations

import ctypes
import mmap
import sys

import torch

PAGE = mmap.PAGESIZE
_MADV_DONTNEED = 4  # linux/mman-common.h
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None
if _libc is not None:
    _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise.restype = ctypes.c_int


def release(t: torch.Tensor) -> int:
    """Drop the whole pages inside ``t``'s bytes (a contiguous CPU tensor whose values are
    dead: they read as zeros afterwards); returns the bytes dropped."""
    if _libc is None or t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
        return 0
    start = t.data_ptr()
    end = start + t.numel() * t.element_size()
    lo, hi = -(-start // PAGE) * PAGE, end // PAGE * PAGE
    if hi <= lo:
        return 0
    return hi - lo if _libc.madvise(lo, hi - lo, _MADV_DONTNEED) == 0 else 0
