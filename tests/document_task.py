"""A task that attends within documents: tiny_lm's model, its loss restricted to the
positions whose target is in the same document as its input (``doc_ids``), weighted by
how far into the document they are (``position_ids``), so a run on it fails without the
fields and its bits depend on them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from examples.tiny_lm.task import TinyLM
from perdure.runtime.replica.task import Task


def make_task(vocab: int = 256) -> Task:
    torch.manual_seed(0)
    model = TinyLM(vocab=vocab, d_model=32, n_layers=1, n_heads=2, dropout=0.0, max_len=128)

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens, docs, pos = batch["tokens"], batch["doc_ids"], batch["position_ids"]
        logits = model(tokens[:, :-1])
        ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        same = (docs[:, 1:] == docs[:, :-1]).float()
        weight = same * (1.0 + pos[:, 1:].float().clamp(max=8) / 8)
        per = (ce * weight).sum(1) / weight.sum(1).clamp(min=1.0)
        return (per * batch["weight"]).sum()

    return Task(model=model, loss_fn=loss_fn, vocab_size=vocab)
