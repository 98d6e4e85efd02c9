"""A task whose loss reads the dataset's ``labels`` and ``loss_mask`` fields: tiny_lm's
model, cross-entropy against ``labels`` (not the shifted tokens), masked per token."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.tiny_lm.task import TinyLM
from perdure.data.fields import FieldSpec
from perdure.runtime.replica.task import Task


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over samples of (masked mean token cross-entropy x weight)."""
    tokens, labels = batch["tokens"], batch["labels"]
    mask = batch["loss_mask"][:, 1:].to(torch.float32)
    logits = model(tokens[:, :-1])
    ce = F.cross_entropy(logits.transpose(1, 2), labels[:, 1:], reduction="none")
    per_sample = (ce * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return (per_sample * batch["weight"]).sum()


def make_task(
    vocab: int = 256,
    d_model: int = 32,
    max_len: int = 64,
    mask_dtype: str | None = "integer",
    mask_len: int | None = None,
) -> Task:
    """``mask_dtype`` / ``mask_len``: what the task declares for ``loss_mask`` (the
    preflight tests declare what a dataset does not hold)."""
    model = TinyLM(vocab=vocab, d_model=d_model, n_layers=1, n_heads=2, max_len=max_len,
                   dropout=0.1)  # fmt: skip
    fields = {
        "labels": FieldSpec("integer", (None,)),
        "loss_mask": FieldSpec(mask_dtype, (mask_len,)),
    }
    return Task(model=model, loss_fn=loss_fn, vocab_size=vocab, max_len=max_len, fields=fields)
