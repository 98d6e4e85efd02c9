"""A task on a dataset without tokens: a small CNN classifying 8x8 uint8 images by their
``labels`` (the layout of scikit-learn's digits), with dropout so the per-slot seeding is
exercised. ``digits``: the synthetic images and labels the tests import."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from perdure.data.fields import FieldSpec
from perdure.runtime.replica.task import Task

SIDE = 8
CLASSES = 10


class SmallCNN(nn.Module):
    def __init__(self, channels: int = 8, dropout: float = 0.1) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, channels, 3, padding=1)
        self.drop = nn.Dropout(dropout)
        self.head = nn.Linear(channels * (SIDE // 2) ** 2, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv(images)), 2)
        return self.head(self.drop(x.flatten(1)))


def loss_fn(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Sum over samples of (cross-entropy x weight); pixels scaled from [0, 255] to [0, 1]."""
    images = batch["images"].to(torch.float32).unsqueeze(1) / 255.0
    ce = F.cross_entropy(model(images), batch["labels"], reduction="none")
    return (ce * batch["weight"]).sum()


def loss_and_accuracy(
    model: nn.Module, batch: dict[str, torch.Tensor]
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``loss_fn``'s loss and, as a sum over samples like it, the correct predictions: the
    step's ``train/accuracy`` is their count over the global batch."""
    images = batch["images"].to(torch.float32).unsqueeze(1) / 255.0
    logits = model(images)
    ce = F.cross_entropy(logits, batch["labels"], reduction="none")
    correct = (logits.argmax(dim=1) == batch["labels"]).to(torch.float32)
    return (ce * batch["weight"]).sum(), {"accuracy": correct.sum()}


def make_task(
    channels: int = 8, dropout: float = 0.1, accuracy: bool = False, declare: str = "accuracy"
) -> Task:
    """``accuracy``: the loss function also returns ``accuracy``, declared in
    ``Task.metrics`` as ``declare`` (another name: what the preflight refuses)."""
    fields = {"images": FieldSpec("uint8", (SIDE, SIDE)), "labels": FieldSpec("integer", ())}
    if accuracy:
        return Task(model=SmallCNN(channels, dropout), loss_fn=loss_and_accuracy,
                    fields=fields, metrics=(declare,))  # fmt: skip
    return Task(model=SmallCNN(channels, dropout), loss_fn=loss_fn, fields=fields)


def digits(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` noisy images (uint8 [n, 8, 8]) of ten fixed patterns, and their class
    (int64 [n]): learnable in a few steps, the same bytes on every machine."""
    rng = np.random.default_rng(seed)
    patterns = rng.integers(0, 2, size=(CLASSES, SIDE, SIDE)) * 200
    labels = rng.integers(0, CLASSES, size=n).astype(np.int64)
    noise = rng.integers(0, 56, size=(n, SIDE, SIDE))
    return (patterns[labels] + noise).astype(np.uint8), labels


def import_digits(root: Path, n: int, part_samples: int = 100) -> Path:
    """``digits(n)`` imported as ``root/ds`` (images and labels, no tokens)."""
    from perdure.data.importer import import_arrays

    out = root / "ds"
    if not (out / "manifest.json").exists():
        images, labels = digits(n)
        np.save(root / "images.npy", images)
        np.save(root / "labels.npy", labels)
        import_arrays({"images": [str(root / "images.npy")], "labels": [str(root / "labels.npy")]},
                      str(out), part_mb=part_samples * 72 / (1 << 20))  # fmt: skip
    return out
