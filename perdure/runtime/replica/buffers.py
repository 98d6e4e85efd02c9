"""Buffers that a forward changes, made a function of the step's slots, not of who ran them.

A BatchNorm layer's forward in training mode updates ``running_mean``, ``running_var`` and
``num_batches_tracked`` in place. Left alone, each replica's buffers would follow only the
slots it computed: they would depend on the worker count and on faults, and replicas would
disagree. The rule perdure applies instead, to every *persistent* floating-point or integer
buffer (those in ``state_dict``, so in checkpoints and in the final hash):

1. every slot's forward starts from the buffers as they were at the start of the step
   (the engine restores them after each slot);
2. a slot's *move* is ``buffer_after - buffer_before``, written into its slot buffer beside
   the gradient and summed over slots by the same reduction;
3. at the update, a floating-point buffer moves by the **mean** of the slots' moves, an
   integer buffer (a counter) by their **sum**.

For BatchNorm this is one running-statistics update with the mean of the slots' batch
statistics (``running_mean = (1 - m) * running_mean + m * mean_s(batch_mean_s)``), and
``num_batches_tracked`` counts every slot's batch, as one sequential process would. It holds
for any buffer a module updates as an exponential moving average; a buffer updated some
other way gets the mean of its slots' changes, whatever that means for it.

Limits, stated: moves travel as float32 (a float64 buffer's move is rounded to float32;
counters are exact up to 2**24 per step); BatchNorm with ``momentum=None`` (a cumulative
average weighted by ``num_batches_tracked``) weights each step as one batch; non-persistent
buffers and boolean buffers are assumed constant (they are not checkpointed either).
"""

from __future__ import annotations

import torch
from torch import nn


def _tracked(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    keys = set(model.state_dict().keys())
    return [
        (name, b)
        for name, b in model.named_buffers()
        if name in keys and (b.is_floating_point() or _is_integer(b))
    ]


def _is_integer(b: torch.Tensor) -> bool:
    return not b.is_floating_point() and not b.is_complex() and b.dtype != torch.bool


class BufferRule:
    """The buffers of one model that a slot may move, and how their moves are applied."""

    def __init__(self, model: nn.Module) -> None:
        self.buffers = _tracked(model)
        self.numel = sum(b.numel() for _, b in self.buffers)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.buffers]

    def snapshot(self) -> list[torch.Tensor]:
        """The step's buffers, to restore after a slot's forward."""
        return [b.detach().clone() for _, b in self.buffers]

    def record(self, saved: list[torch.Tensor], moves: torch.Tensor | None) -> None:
        """Write each buffer's move since ``saved`` into ``moves`` (skipped when None, for a
        forward that failed) and put the buffers back as they were."""
        offset = 0
        for (_, b), before in zip(self.buffers, saved, strict=True):
            n = b.numel()
            if moves is not None:
                delta = b.detach().double() - before.double()
                moves[offset : offset + n].copy_(delta.reshape(-1))
            b.data.copy_(before)
            offset += n

    def apply(self, moves: torch.Tensor, slots: int) -> None:
        """Move each buffer by the reduced moves: the mean over ``slots`` for a float
        buffer, the sum (rounded: exact for counters) for an integer one."""
        offset = 0
        for _, b in self.buffers:
            n = b.numel()
            total = moves[offset : offset + n].view_as(b).to(b.device)
            if b.is_floating_point():
                b.data.add_((total / slots).to(b.dtype))
            else:
                b.data.add_(torch.round(total).to(b.dtype))
            offset += n
