"""What the peer scripts share: the same tiny_lm model, synthetic batches, a step log."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def model_and_loss(d_model: int, n_layers: int, n_heads: int):
    import torch

    from examples.tiny_lm.task import make_task

    torch.manual_seed(1234)
    task = make_task(d_model=d_model, n_layers=n_layers, n_heads=n_heads, dropout=0.1)
    return task.model, task.loss_fn


def batch(step: int, rank: int, n: int, seq: int = 129):
    """Synthetic byte tokens (data loading is not what these benchmarks compare)."""
    import torch

    g = torch.Generator().manual_seed(step * 1000 + rank)
    return {"tokens": torch.randint(0, 256, (n, seq), generator=g), "weight": torch.ones(n)}


def log(path: str, **rec) -> None:
    line = json.dumps({"t": time.time(), "pid": os.getpid(), **rec}) + "\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line.encode())
    finally:
        os.close(fd)


def maybe_kill(path: str, marker: str, step: int, kill_at: int, me: bool) -> None:
    """SIGKILL this process once, after committing step ``kill_at`` (a marker file makes
    the restarted process go on)."""
    if me and step == kill_at and not os.path.exists(marker):
        Path(marker).touch()
        log(path, event="fault", step=step)
        os.kill(os.getpid(), signal.SIGKILL)
