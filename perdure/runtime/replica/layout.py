"""The flat slot buffer's layout:
``[P gradient values | Q buffer moves | S non-finite flags | S losses | M x S metrics]``.

The M x S metrics are the task's own (``Task.metrics``, returned by ``loss_fn`` beside the
loss): metric ``m`` of slot ``s`` at ``m * S + s``, set by that slot alone, like its loss.

One slot's gradient fills the first part, and the change its forward made to the model's
buffers (BatchNorm's running statistics, a user's counters: see ``buffers.BufferRule``) the
second; it sets only its own flag (0, :data:`BAD` or :data:`OVERFLOW`) and loss. Summed over
slots by the reduction, the tail tells every replica which slots were non-finite and what
each slot's loss was, with no extra message. Everything that reads or writes a slot
buffer (the slot engine, the step runner, the reducer, the trainer's update) goes through
this object, so the layout can change in one place (a sharded layout, another dtype).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BAD = 1.0
"""A slot's flag: its loss is non-finite, or (without a loss scale) any of its values:
the data path (re-run elsewhere, quarantine or blame: ``step.StepRunner``)."""
OVERFLOW = 2.0
"""A slot's flag under a loss scale (``train.precision = "fp16"``): its loss is finite and
its gradient is not: the scale's, never the data's or the worker's
(``replica/loss_scale.py``)."""


@dataclass(frozen=True)
class GradLayout:
    """Where each part of a slot buffer lives."""

    numel: int
    """P: gradient values (every trainable parameter, in reverse layer order)."""
    slots: int
    """S: slots per step."""
    moves: int = 0
    """Q: buffer values a slot's forward may change (0 for a model without such buffers)."""
    device: str = "cpu"
    metrics: int = 0
    """M: the task's own metrics (``Task.metrics``), one value per slot each."""

    @property
    def size(self) -> int:
        return self.numel + self.moves + (2 + self.metrics) * self.slots

    def new_buffer(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float32, device=self.device)

    def grads(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[: self.numel]

    def buffer_moves(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.numel : self.numel + self.moves]

    def values(self, flat: torch.Tensor) -> torch.Tensor:
        """Gradients and buffer moves: what must be finite for a slot to count."""
        return flat[: self.numel + self.moves]

    def flags(self, flat: torch.Tensor) -> torch.Tensor:
        start = self.numel + self.moves
        return flat[start : start + self.slots]

    def losses(self, flat: torch.Tensor) -> torch.Tensor:
        start = self.numel + self.moves + self.slots
        return flat[start : start + self.slots]

    def user_metrics(self, flat: torch.Tensor) -> torch.Tensor:
        """``[M, S]``: each task metric's value per slot."""
        start = self.numel + self.moves + 2 * self.slots
        return flat[start:].view(self.metrics, self.slots)

    def tail(self, flat: torch.Tensor) -> torch.Tensor:
        """Flags, losses and metrics together (cleared before a slot sets its own)."""
        return flat[self.numel + self.moves :]

    def bad_slots(self, flat: torch.Tensor) -> list[int]:
        """The slots whose flag is set in a reduced buffer (either kind)."""
        return [int(i) for i in torch.nonzero(self.flags(flat)).flatten()]

    def overflow_slots(self, flat: torch.Tensor) -> list[int]:
        """The slots flagged :data:`OVERFLOW` in a reduced buffer."""
        return [int(i) for i in torch.nonzero(self.flags(flat) == OVERFLOW).flatten()]
