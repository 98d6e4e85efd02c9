"""A test task with an evaluation function: the held-out loss and next-token accuracy,
and a draw from the global generators that must not leak into the training."""

from __future__ import annotations

import random

import numpy as np
import torch
import torch.nn.functional as F

from examples.tiny_lm.task import make_task as tiny
from perdure.runtime.replica.task import Task

SMALL = {"d_model": 32, "n_layers": 1, "n_heads": 2, "dropout": 0.1, "max_len": 128}


def eval_fn(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, object]:
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:])
    right = (logits.argmax(-1) == tokens[:, 1:]).float().mean()
    # Draws from every global generator: seeded per batch, restored after the evaluation.
    jitter = float(torch.rand(())) + float(np.random.random()) + random.random()
    return {"loss": ce, "accuracy": right, "jitter": jitter}


def with_eval(own_eval: bool = True) -> Task:
    task = tiny(**SMALL)
    if own_eval:
        task.eval_fn = eval_fn
    return task


def broken_eval() -> Task:
    task = tiny(**SMALL)
    task.eval_fn = lambda model, batch: {"loss": "low"}
    return task
