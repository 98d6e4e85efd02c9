"""Test tasks whose forward changes buffers: BatchNorm1d and BatchNorm2d, and a module that
registers its own (an EMA of its input's scale and an integer counter of samples seen)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from perdure.runtime.replica.task import Task


class Tally(nn.Module):
    """Its own buffers: ``seen`` counts samples (int64), ``scale`` is an EMA of the input's
    mean absolute value (float32), both updated in place by forward in training mode."""

    def __init__(self, momentum: float = 0.2) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("seen", torch.zeros((), dtype=torch.int64))
        self.register_buffer("scale", torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.seen += x.shape[0]
                self.scale.lerp_(x.abs().mean(), self.momentum)
        return x / self.scale


class BufferLM(nn.Module):
    def __init__(self, vocab: int = 256, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.bn1 = nn.BatchNorm1d(d)
        self.bn2 = nn.BatchNorm2d(d)
        self.tally = Tally()
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens).transpose(1, 2)  # (N, d, L)
        x = self.bn1(x)
        x = self.bn2(x.unsqueeze(-1)).squeeze(-1)
        x = self.tally(self.drop(x.transpose(1, 2)))
        return self.head(x)


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
    return (ce.mean(dim=1) * batch["weight"]).sum()


def make_task(d: int = 16) -> Task:
    return Task(model=BufferLM(d=d), loss_fn=loss_fn, vocab_size=256, max_len=1024)


def make_diverging_task(d: int = 16) -> Task:
    """A model whose state changes outside the step's math: an optimizer hook writes each
    process's own id into a buffer, so no two replicas agree on it."""
    task = make_task(d)
    model = task.model
    model.register_buffer("marker", torch.zeros((), dtype=torch.int64))

    def make_optimizer(params: object, cfg: object) -> torch.optim.Optimizer:
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        opt.register_step_post_hook(lambda *_: model.marker.fill_(os.getpid()))
        return opt

    task.make_optimizer = make_optimizer  # type: ignore[assignment]
    return task
