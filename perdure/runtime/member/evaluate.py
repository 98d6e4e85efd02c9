"""Evaluation during a run: the task's ``eval_fn`` over fixed held-out samples, every
``eval.every_steps`` steps, on one member, never changing the math.

Who and when: every member of the running epoch, after a step whose count of committed
steps is a multiple of ``eval.every_steps`` has committed (its update applied, its metrics
line written), before it begins the next step; the member of rank 0 writes the line.
Every member evaluates, not rank 0 alone, because the others would only wait for it at
the next step's first collective, and an evaluation longer than the collective timeout
(a backstop of ten step times or so) would fail the epoch: the wall time is the same, the
others' work is redundant. The evaluation is not spread over slots (an evaluation of a
few hundred samples is short next to the steps between two of them). Rank 0 changes with
the membership; the samples and the weights do not, so the numbers do not either.

Why it cannot change a bit of the training: it runs under ``torch.no_grad()`` (no
gradient is touched) with the model in ``eval()`` mode (BatchNorm does not update its
running statistics; the mode is restored after), and every global generator (torch's,
CUDA's, numpy's, Python's) is saved before each batch, seeded from (seed, step, batch)
and restored after it (``user_rng.SlotRng``), so what the next step draws is what it
would have drawn without an evaluation. The test runs a run both ways and compares the
final hashes.

Determinism: the samples are evenly spaced ids over the held-out data set
(``eval.samples`` of them, or all), read in id order in batches of ``eval.batch_size``;
the batches' results are averaged weighted by their sample counts in that order. So two
evaluations of the same weights give the same numbers, whoever runs them.

Limits: with ``train.shard_params`` no member holds the whole parameters, so evaluation
is refused there (the config says so). A rank 0 that dies during an evaluation takes its
line with it: that step's evaluation is missing from the logs (the step is not lost).
An error raised by ``eval_fn`` stops the run like an error of ``loss_fn`` (a
``MathError``), at the first evaluation.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import time
from collections.abc import Callable, Iterator
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from perdure.data import Dataset
from perdure.runtime.config import EvalConfig
from perdure.runtime.replica.slots import autocast_for
from perdure.runtime.replica.task import Task, split_loss
from perdure.runtime.replica.user_rng import SlotRng


class EvalError(RuntimeError):
    """The task's evaluation function failed or returned something unusable."""


def eval_ids(num_samples: int, samples: int) -> np.ndarray:
    """The sample ids an evaluation reads: ``samples`` evenly spaced ids over
    ``[0, num_samples)`` (all of them when ``samples`` is 0 or at least ``num_samples``).
    Pure."""
    n = num_samples if samples == 0 else min(samples, num_samples)
    return (np.arange(n, dtype=np.int64) * num_samples) // max(n, 1)


def eval_seed(seed: int, step: int, batch: int) -> int:
    """A 63-bit seed of an evaluation batch, apart from every slot's seed."""
    digest = hashlib.blake2b(f"eval:{seed}:{step}:{batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def due(cfg: EvalConfig, committed: int) -> bool:
    """Whether an evaluation follows the step that made ``committed`` steps."""
    return cfg.every_steps > 0 and committed > 0 and committed % cfg.every_steps == 0


class Evaluator:
    """The evaluation of one worker: its held-out data set, opened once."""

    def __init__(
        self,
        task: Task,
        cfg: EvalConfig,
        dataset: Dataset,
        *,
        seed: int,
        precision: str = "fp32",
        device: torch.device | None = None,
    ) -> None:
        self.task, self.cfg, self.dataset, self.seed = task, cfg, dataset, seed
        self.model: nn.Module = task.model
        self.device = device or torch.device("cpu")
        self.precision = precision
        self.ids = eval_ids(dataset.num_samples, cfg.samples)
        fn = task.eval_fn or task.loss_fn
        self.rng = SlotRng(fn, self.model)

    def close(self) -> None:
        self.dataset.close()

    def run(self, step: int) -> dict[str, float]:
        """The metrics of the weights after ``step``: ``eval/<name>`` means over the
        evaluated samples."""
        sums: dict[str, float] = {}
        size = self.cfg.batch_size
        with self._eval_mode(), torch.no_grad():
            for b, lo in enumerate(range(0, self.ids.size, size)):
                ids = self.ids[lo : lo + size]
                batch = self._batch(ids)
                with self.rng.slot(eval_seed(self.seed, step, b), step, b), self._autocast():
                    got = self._call(batch)
                for name, value in got.items():
                    sums[name] = sums.get(name, 0.0) + value * ids.size
        return {f"eval/{k}": v / self.ids.size for k, v in sums.items()}

    def _batch(self, ids: np.ndarray) -> dict[str, torch.Tensor]:
        values, bad = self.dataset.read_fields(ids)
        if bad:
            raise next(iter(bad.values()))
        out = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in values.items()}
        out["weight"] = torch.ones(ids.size, dtype=torch.float32)
        if self.device.type != "cpu":
            out = {k: v.to(self.device) for k, v in out.items()}
        return out

    def _call(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        if self.task.eval_fn is None:
            out = self.task.loss_fn(self.model, batch)
            loss, extra = split_loss(out, tuple(self.task.metrics))
            values = {"loss": _number("task.loss_fn", "loss", loss), **extra}
            if self.task.loss_reduction == "sum":
                values = {k: v / batch["weight"].shape[0] for k, v in values.items()}
            return values
        got = self.task.eval_fn(self.model, batch)
        if isinstance(got, torch.Tensor):
            return {"loss": _number("task.eval_fn", "loss", got)}
        if not isinstance(got, dict) or not got:
            raise EvalError(
                "task.eval_fn: must return a non-empty dict of named numbers or a scalar "
                f"tensor (got {type(got).__name__})"
            )
        return {str(k): _number("task.eval_fn", str(k), v) for k, v in got.items()}

    @contextlib.contextmanager
    def _eval_mode(self) -> Iterator[None]:
        modes = [(m, m.training) for m in self.model.modules()]
        self.model.eval()
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        """The training forward's autocast (``fp16`` needs no loss scale: no backward)."""
        made = autocast_for(self.device, self.precision)()
        return cast(contextlib.AbstractContextManager[Any], made)


def _number(where: str, name: str, value: Any) -> float:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise EvalError(f"{where}: {name!r} must be one number (got shape "
                            f"{tuple(value.shape)})")  # fmt: skip
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise EvalError(f"{where}: {name!r} must be a number (got {type(value).__name__})")
    return float(value)


def evaluate_logged(
    evaluator: Evaluator, step: int, write: Callable[[dict[str, Any]], None], worker: str
) -> dict[str, Any]:
    """Run the evaluation of ``step`` and write its metrics line (``eval_step``: the step
    after whose update the weights were evaluated); returns the line."""
    t0 = time.monotonic()
    metrics = evaluator.run(step)
    line: dict[str, Any] = {
        "eval_step": step,
        **{k: (v if math.isfinite(v) else None) for k, v in metrics.items()},
        "eval_samples": int(evaluator.ids.size),
        "eval_s": round(time.monotonic() - t0, 6),
        "worker": worker,
    }
    write(line)
    return line
