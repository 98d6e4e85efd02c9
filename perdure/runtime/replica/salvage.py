"""Partial-step salvage: the slots a member finished survive a membership change.

A slot's gradient is a pure function of the replica's state at the start of the step, the
step, the slot and its data (the design invariant). When a member dies mid-step, the
survivors' finished slot buffers of that step are still exactly what the new epoch would
compute for those slots: a survivor whose new slot range overlaps its old one copies those
buffers instead of recomputing them, and only the slots it did not hold (the dead member's
share, re-apportioned) are computed again. A kill then costs a fraction of a step.

A buffer is reused only under the same *key*: the step and the replica's state version
(``Trainer.state_version``, which changes with every update, received state, restored
checkpoint and quarantine, since the same slot position then holds other samples). A step
whose reduction found non-finite slots drops everything (a suspect worker's slot must be
recomputed, not copied). Only slots whose backward completed are recorded.

The forms that add a member's slots into one accumulator (``comm/streamed.py``) keep a
*partial sum* instead: the integers of the slots the member had added when its pass was
abandoned (between slots, before its last slot went on the wire), with the peaks and
outliers beside them, under the same key. It is taken whole or not at all: a member whose
new slots include every one of them starts its pass from it and computes the others
(integer addition is associative: the same bits); otherwise it computes its slots again.

Memory: the kept buffers are the previous epoch runner's own (no copy is made until they
are reused), and a partial sum is the abandoned pass's accumulator itself; both are
released with the key's change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class SlotSalvage:
    """Finished slot buffers of one step, kept across membership epochs."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.slots: dict[int, torch.Tensor] = {}
        self.summed: tuple[tuple[int, ...], Any] | None = None
        """A partial sum under :attr:`key`: its slots and the reducer's opaque state."""
        self.reused: list[int] = []

    def _at(self, key: tuple[int, int]) -> None:
        if key != self.key:
            self.key, self.slots, self.summed = key, {}, None

    def put(self, key: tuple[int, int], slot: int, buf: torch.Tensor) -> None:
        """Record ``buf`` (complete) as slot ``slot`` under ``key``."""
        self._at(key)
        self.slots[slot] = buf

    def put_sum(self, key: tuple[int, int], slots: Sequence[int], partial: Any) -> None:
        """Record a reducer's partial sum of ``slots`` under ``key`` (the last one kept)."""
        self._at(key)
        self.summed = (tuple(sorted(slots)), partial)

    def take_sum(self, key: tuple[int, int], slots: Sequence[int]) -> tuple[tuple[int, ...], Any]:
        """The partial sum under ``key`` whose slots are all among ``slots`` (a pass of
        them may start from it), handed over once; else ``((), None)``."""
        got = self.summed if key == self.key else None
        if got is None or not set(got[0]) <= set(slots):
            return (), None
        self.summed = None
        return got

    def reused_sum(self, slots: Sequence[int]) -> None:
        """A pass started from a partial sum of ``slots`` (logged as reused)."""
        self.reused.extend(slots)

    def take(self, key: tuple[int, int], slot: int, into: torch.Tensor) -> bool:
        """Copy slot ``slot`` of ``key`` into ``into``; False when it is not kept. A slot
        copied from another buffer (an earlier epoch's) is counted in ``reused``."""
        buf = self.slots.get(slot) if key == self.key else None
        if buf is None:
            return False
        if buf is not into:
            into.copy_(buf)
            self.reused.append(slot)
        return True

    def held(self, key: tuple[int, int]) -> list[int]:
        """The slots kept under ``key`` (what a member reports when it is ready to redo
        that step), in order."""
        if key != self.key:
            return []
        summed = set(self.summed[0]) if self.summed is not None else set()
        return sorted(set(self.slots) | summed)

    def pop_reused(self) -> list[int]:
        out, self.reused = self.reused, []
        return out

    def clear(self) -> None:
        self.key, self.slots, self.summed = None, {}, None
