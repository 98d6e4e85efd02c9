"""A task for the paced copy's benchmark (``bench_kill_cost.py --model frozen``): the
examples' tiny_lm beside a frozen base of ``frozen_mb`` MB in ``frozen_tensors`` tensors.

Why: a copy longer than one step is what ``cluster.copy_step_mb`` is for, and on this
machine's 2 cores a state's copy and a step's reduction both cost CPU per byte, so a
plain model's copy (16 bytes a parameter with AdamW) stays within a step (whose
reduction moves 4 bytes a parameter and whose compute is per token). Frozen tensors are
state a copy moves and a reduction does not (no gradient, no optimizer state): a
fine-tuning run beside a frozen base, whose compute with it this stand-in leaves out (it
is not used in the forward), so that the state is large against the step as it is on an
accelerator whose step is short against its link.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from examples.tiny_lm.task import make_task as tiny_lm_task
from perdure.runtime.replica.task import Task


class FrozenBase(nn.Module):
    """tiny_lm and its frozen base (zeros: cheap to build for the replacement that starts
    beside the members, and a copy moves bytes whatever they hold)."""

    def __init__(self, lm: nn.Module, frozen_mb: float, frozen_tensors: int) -> None:
        super().__init__()
        self.lm = lm
        n = max(1, int(frozen_mb * 1e6 / 4 / frozen_tensors))
        self.base = nn.ParameterList(
            nn.Parameter(torch.zeros(n), requires_grad=False) for _ in range(frozen_tensors)
        )

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(tokens)


def make_task(frozen_mb: float = 64.0, frozen_tensors: int = 16, **lm: Any) -> Task:
    """tiny_lm's task (``lm``: its options) with the frozen base beside its model."""
    task = tiny_lm_task(**lm)
    return dataclasses.replace(task, model=FrozenBase(task.model, frozen_mb, frozen_tensors))
