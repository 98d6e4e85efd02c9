"""The flat slot buffer's layout: ``[P gradient values | S non-finite flags | S losses]``.

One slot's gradient fills the first part; it sets only its own flag and loss. Summed over
slots by the reduction, the tail tells every replica which slots were non-finite and what
each slot's loss was, with no extra message. Everything that reads or writes a slot
buffer (the slot engine, the step runner, the reducer, the trainer's update) goes through
this object, so the layout can change in one place (a sharded layout, another dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GradLayout:
    """Where each part of a slot buffer lives."""

    numel: int
    """P: gradient values (every trainable parameter, in reverse layer order)."""
    slots: int
    """S: slots per step."""
    device: str = "cpu"

    @property
    def size(self) -> int:
        return self.numel + 2 * self.slots

    def new_buffer(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float32, device=self.device)

    def grads(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[: self.numel]

    def flags(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.numel : self.numel + self.slots]

    def losses(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.numel + self.slots :]

    def tail(self, flat: torch.Tensor) -> torch.Tensor:
        """Flags and losses together (cleared before a slot sets its own)."""
        return flat[self.numel :]

    def bad_slots(self, flat: torch.Tensor) -> list[int]:
        """The slots whose flag is set in a reduced buffer."""
        return [int(i) for i in torch.nonzero(self.flags(flat)).flatten()]
