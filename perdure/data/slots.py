"""Slot addressing: which global order positions form slot ``s`` of step ``t``.

Step ``t``'s global batch is positions ``[t*B, (t+1)*B)``; slot ``s`` is its contiguous
``[t*B + s*B/S, t*B + (s+1)*B/S)``. Pure functions: no state, no I/O.
"""

from __future__ import annotations

import numpy as np

from perdure.data.errors import DataError


def check_slots(global_batch: int, slots: int) -> int:
    """Samples per slot; raise unless ``global_batch`` is a positive multiple of ``slots``."""
    if slots < 1 or global_batch < 1 or global_batch % slots:
        raise DataError(
            f"slots: global_batch must be a positive multiple of slots "
            f"(got global_batch={global_batch}, slots={slots})"
        )
    return global_batch // slots


def slot_positions(step: int, slot: int, global_batch: int, slots: int) -> np.ndarray:
    """Global positions of slot ``slot`` of step ``step`` (int64, ascending)."""
    per = check_slots(global_batch, slots)
    if step < 0 or not 0 <= slot < slots:
        raise DataError(f"slots: need step >= 0 and 0 <= slot < {slots} (got {step}, {slot})")
    start = step * global_batch + slot * per
    return np.arange(start, start + per, dtype=np.int64)
