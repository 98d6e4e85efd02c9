"""A task whose loss draws from the user's generators (random token masking, as in masked
language modelling): tiny_lm's model, cross-entropy over the positions the draws keep.

``source`` picks the generators: ``numpy`` (numpy's global), ``generator``
(``perdure.slot_generator()``), ``python`` (``random``), ``all`` (the three at once), or a
generator perdure cannot seed, held by the task: ``own_numpy`` (a module global
``default_rng``), ``own_python`` (a ``random.Random`` in the closure), ``own_torch`` (a
``torch.Generator`` on the model).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import perdure
from examples.tiny_lm.task import TinyLM
from perdure.runtime.replica.task import Task

OWN_RNG = np.random.default_rng(0)
"""A generator the task holds: perdure cannot seed it."""


def _draws(source: str, own_python: random.Random) -> Callable[[nn.Module, int], np.ndarray]:
    """``draw(model, n)``: n uniform values in [0, 1) from ``source``'s generators."""

    def draw(model: nn.Module, n: int) -> np.ndarray:
        if source == "numpy":
            return np.random.random(n)
        if source == "generator":
            return perdure.slot_generator().random(n)
        if source == "python":
            return np.array([random.random() for _ in range(n)])
        if source == "all":
            a = np.random.random(n) + perdure.slot_generator().random(n)
            return (a + np.array([random.random() for _ in range(n)])) / 3
        if source == "own_numpy":
            return OWN_RNG.random(n)
        if source == "own_python":
            return np.array([own_python.random() for _ in range(n)])
        assert source == "own_torch", source
        return torch.rand(n, generator=model.gen).numpy()  # type: ignore[arg-type]

    return draw


def make_task(
    source: str = "all",
    vocab: int = 256,
    d_model: int = 32,
    max_len: int = 128,
    dropout: float = 0.1,
    n_layers: int = 1,
    n_heads: int = 2,
) -> Task:
    model = TinyLM(
        vocab=vocab,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        dropout=dropout,
        max_len=max_len,
    )
    model.gen = torch.Generator().manual_seed(0)  # type: ignore[assignment]
    draw = _draws(source, random.Random(0))

    def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = batch["tokens"]
        n, t = tokens.shape[0], tokens.shape[1] - 1
        keep = torch.from_numpy(draw(model, n * t).reshape(n, t) < 0.8).float()
        logits = model(tokens[:, :-1])
        ce = F.cross_entropy(logits.transpose(1, 2), tokens[:, 1:], reduction="none")
        per_sample = (ce * keep).sum(dim=1) / keep.sum(dim=1).clamp(min=1.0)
        return (per_sample * batch["weight"]).sum()

    return Task(model=model, loss_fn=loss_fn, vocab_size=vocab, max_len=max_len)
