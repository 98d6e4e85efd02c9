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

Memory: the kept buffers are the previous epoch runner's own (no copy is made until they
are reused), released with the key's change.
"""

from __future__ import annotations

import torch


class SlotSalvage:
    """Finished slot buffers of one step, kept across membership epochs."""

    def __init__(self) -> None:
        self.key: tuple[int, int] | None = None
        self.slots: dict[int, torch.Tensor] = {}
        self.reused: list[int] = []

    def put(self, key: tuple[int, int], slot: int, buf: torch.Tensor) -> None:
        """Record ``buf`` (complete) as slot ``slot`` under ``key``."""
        if key != self.key:
            self.key, self.slots = key, {}
        self.slots[slot] = buf

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
        return sorted(self.slots) if key == self.key else []

    def pop_reused(self) -> list[int]:
        out, self.reused = self.reused, []
        return out

    def clear(self) -> None:
        self.key, self.slots = None, {}
