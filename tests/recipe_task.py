"""Test tasks with users' own recipes: two param groups at their own rates, a scheduler,
a mean loss, and a compiled model."""

from __future__ import annotations

from typing import Any

import torch

from examples.tiny_lm.task import loss_fn as sum_loss
from examples.tiny_lm.task import make_task as tiny
from perdure.runtime.replica.task import Task

SMALL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "dropout": 0.1, "max_len": 128}


def two_groups(weight_decay: float = 0.0) -> Task:
    """Embeddings at 1e-4, everything else at 1e-3 (AdamW)."""
    task = tiny(**SMALL)
    model = task.model

    def make_optimizer(params: Any, cfg: Any) -> torch.optim.Optimizer:
        emb = [model.tok.weight, model.pos.weight]
        rest = [p for p in model.parameters() if all(p is not e for e in emb)]
        groups = [{"params": rest, "lr": 1e-3}, {"params": emb, "lr": 1e-4}]
        return torch.optim.AdamW(groups, weight_decay=weight_decay, foreach=False)

    task.make_optimizer = make_optimizer
    return task


def with_scheduler(step_size: int = 5) -> Task:
    task = tiny(**SMALL)
    task.make_scheduler = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size, gamma=0.5)
    return task


def mean_loss(declare: str = "mean") -> Task:
    def loss(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return sum_loss(model, batch) / batch["weight"].shape[0]

    task = tiny(**SMALL)
    task.loss_fn = loss
    task.loss_reduction = declare  # type: ignore[assignment]
    return task


def sum_declared_as_mean() -> Task:
    task = tiny(**SMALL)
    task.loss_reduction = "mean"
    return task


def compiled() -> Task:
    task = tiny(**SMALL)
    task.model = torch.compile(task.model, backend="eager")  # type: ignore[assignment]
    return task


def one_cycle(total_steps: int = 20) -> Task:
    """Two AdamW groups (``body``, ``embeddings``) under the task's own OneCycleLR."""
    task = two_groups()
    make = task.make_optimizer
    assert make is not None

    def make_optimizer(params: Any, cfg: Any) -> torch.optim.Optimizer:
        opt = make(params, cfg)
        for group, name in zip(opt.param_groups, ("body", "embeddings"), strict=True):
            group["name"] = name
        return opt

    task.make_optimizer = make_optimizer
    task.make_scheduler = lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=[1e-2, 1e-3], total_steps=total_steps
    )
    return task


def undeclared_vocab(vocab: int = 64) -> Task:
    """A model of ``vocab`` token ids that does not declare ``vocab_size``."""
    task = tiny(**SMALL, vocab=vocab)
    task.vocab_size = None
    return task
