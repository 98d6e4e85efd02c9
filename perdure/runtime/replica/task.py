"""The task API: what a user hands perdure, and how perdure builds it deterministically.

A task is an importable factory ``module:function`` returning a :class:`Task`. perdure seeds
the global generator with the run seed before calling it, so every replica (and every
replacement worker) builds bitwise-identical initial parameters without a broadcast.
"""

from __future__ import annotations

import importlib
import math
import os
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from perdure.data.fields import FieldSpec
from perdure.runtime.config import OptimConfig, TaskConfig
from perdure.runtime.replica.deferred import Init, build_deferred
from perdure.runtime.replica.user_rng import seed_globals

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], "torch.Tensor | tuple[torch.Tensor, dict]"]
EvalFn = Callable[[nn.Module, dict[str, torch.Tensor]], "torch.Tensor | dict[str, Any]"]
OptimizerFactory = Callable[[Iterable[nn.Parameter], OptimConfig], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]
LOSS_REDUCTIONS = ("sum", "mean")


@dataclass
class Task:
    """A model, its loss over a batch, and optionally its own optimizer and scheduler.

    ``loss_fn(model, batch)`` returns, over the batch's samples, the sum (``loss_reduction =
    "sum"``, the default) or the mean (``"mean"``) of each sample's loss times
    ``batch["weight"]`` (1.0, or NaN for samples of a poisoned dataset part). perdure scales a mean
    to a sum itself, adds the slot sums in slot order and divides by the global batch once,
    so the result does not depend on how samples are grouped into slots. The launcher's
    preflight checks the declaration on real samples (``recipe.check_loss_reduction``).

    The learning rate: with ``make_scheduler``, the task's scheduler owns it (perdure calls
    ``scheduler.step()`` after every optimizer step and checkpoints its ``state_dict``; the
    config's ``optim.schedule`` must stay ``"constant"`` with no warm-up). Without one, the
    config's schedule scales each param group's *own* initial learning rate, so a custom
    optimizer's per-group rates keep their ratios.

    ``vocab_size`` and ``max_len``, when given, let the launcher's preflight refuse a
    dataset the model cannot read before any worker starts: token ids at or above
    ``vocab_size`` (the dataset's manifest records its vocabulary), or samples longer than
    ``max_len`` tokens (the model reads ``seq_len`` of them). Left ``None``, nothing is
    checked and such a mismatch shows only as the workers' error.
    """

    model: nn.Module
    loss_fn: LossFn
    make_optimizer: OptimizerFactory | None = None
    make_scheduler: SchedulerFactory | None = None
    """``make_scheduler(optimizer)``: a ``torch.optim.lr_scheduler`` (anything with
    ``step()``, ``state_dict()`` and ``load_state_dict()``), stepped once per step."""
    loss_reduction: Literal["sum", "mean"] = "sum"
    """What ``loss_fn`` returns over a slot's samples: their sum, or their mean."""
    vocab_size: int | None = None
    """Token ids the model accepts: ``[0, vocab_size)`` (e.g. its embedding's rows)."""
    max_len: int | None = None
    """Longest token sequence the model reads (e.g. its position embedding's rows)."""
    fields: dict[str, FieldSpec] | None = None
    """The dataset fields ``loss_fn`` reads besides ``weight`` (e.g. ``{"labels":
    FieldSpec("integer", (None,)), "loss_mask": FieldSpec(shape=(None,))}``): preflight
    refuses a dataset that lacks one or holds it with another dtype or shape."""
    metrics: tuple[str, ...] = ()
    """Names of the task's own training metrics: ``loss_fn`` then returns ``(loss,
    {"accuracy": ..., ...})`` (a tuple, as a PyTorch training step returns its extras
    beside the loss), each value a number or one-element tensor reduced over the slot's
    samples like the loss (a sum, or a mean under ``loss_reduction = "mean"``); the keys
    must be exactly these names. perdure adds the slot values in slot order and divides
    by the global batch, as for the loss (so the bits do not depend on the membership),
    and logs ``train/<name>`` to every sink (metrics.jsonl, TensorBoard, W&B, Prometheus
    ``perdure_train{metric}``, the live view and the report). They are not
    differentiated (detached)."""
    init: Init | None = None
    """With ``task.init = "per_module"``: ``init(name, module)`` initialises the direct
    parameters of the module ``name`` in place (under a generator seeded for that module)
    and returns True, or returns False to leave them to the module's
    ``reset_parameters()``. What a factory's own code does to parameters after building
    them (``nn.init.normal_(self.tok.weight, std=0.02)``) does nothing there: parameters
    are on ``meta`` while the factory runs. Unused with ``eager``."""
    eval_fn: EvalFn | None = None
    """``eval_fn(model, batch)``: the evaluation of one batch of the held-out data set
    (``[eval]`` in the config, ``runtime/member/evaluate.py``), called under ``torch.no_grad()``
    with the model in ``eval()`` mode (dropout off, BatchNorm on its running statistics).
    It returns a dict of named numbers (floats or one-element tensors), each the *mean*
    over the batch's samples (``{"loss": ..., "accuracy": ...}``), or one tensor, the mean
    loss. perdure averages each over the batches weighted by their sample counts (the mean
    over every evaluated sample) and logs them as ``eval/<name>`` to every sink. Unset:
    ``loss_fn``'s loss (per sample, after ``loss_reduction``) is logged as ``eval/loss``.
    The batch is the training batches' dict (``tokens``, ``weight`` all ones, the data
    set's other fields). Its randomness, if any, is seeded from (seed, step, batch) and
    the training generators are restored after it: evaluation never changes the math."""


def default_optimizer(params: Iterable[nn.Parameter], cfg: OptimConfig) -> torch.optim.Optimizer:
    """AdamW or SGD from the optim config, single-tensor (foreach=False) for stable bits."""
    if cfg.name == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, foreach=False)
    b1, b2 = cfg.betas
    return torch.optim.AdamW(
        params, lr=cfg.lr, betas=(b1, b2), eps=cfg.eps, weight_decay=cfg.weight_decay, foreach=False
    )


def resolve(entry: str, base_dir: str | None = None) -> Callable[..., Any]:
    """Import ``module:function``, from an installed package or else from ``base_dir``
    (the config's ``run.base_dir``; the working directory when None); errors name the
    entry and what went wrong."""
    module, _, name = entry.partition(":")
    root = base_dir or os.getcwd()
    if root not in sys.path:  # appended: an installed package of that name wins
        sys.path.append(root)
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise ValueError(f"task.entry: cannot import module {module!r} ({e})") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"task.entry: {module!r} has no callable {name!r}")
    return fn


def build_task(cfg: TaskConfig, seed: int, base_dir: str | None = None) -> Task:
    """Build the task with the generator seeded by ``seed`` (identical on every replica).
    With ``task.init = "per_module"`` its parameters are on ``meta``: the caller gives
    them their bytes (``deferred.SeedInit``)."""
    seed_globals(seed)  # numpy's and Python's too: their states outside slots follow the seed
    factory = resolve(cfg.entry, base_dir)
    if cfg.init == "per_module":
        task = build_deferred(lambda: factory(**cfg.options))
    else:
        task = factory(**cfg.options)
    if not isinstance(task, Task):
        raise ValueError(f"task.entry: {cfg.entry!r} returned {type(task).__name__}, not a Task")
    if task.loss_reduction not in LOSS_REDUCTIONS:
        raise ValueError(
            f"task.entry: {cfg.entry!r} returned a Task whose loss_reduction must be one of "
            f"{list(LOSS_REDUCTIONS)} (got {task.loss_reduction!r})"
        )
    return task


def build_optimizer(task: Task, cfg: OptimConfig) -> torch.optim.Optimizer:
    factory = task.make_optimizer or default_optimizer
    return factory(task.model.parameters(), cfg)


def plain_module(model: nn.Module) -> nn.Module:
    """The module under ``torch.compile``'s wrapper (whose state-dict keys gain an
    ``_orig_mod.`` prefix): checkpoints and state copies use the plain module's keys, so a
    compiled run and an eager one read each other's checkpoints."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model


def lr_at(step: int, cfg: OptimConfig, total_steps: int, base: float | None = None) -> float:
    """The learning rate of ``step`` for a param group whose initial rate is ``base``
    (``optim.lr`` when None): a pure function of the step, the config and ``base``."""
    lr = cfg.lr if base is None else base
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return lr
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    floor = cfg.min_lr_ratio * lr
    return floor + (lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


class LossFnError(ValueError):
    """``loss_fn`` returned something other than its declared shape (``split_loss``)."""


def split_loss(
    out: object, names: tuple[str, ...], where: str = "task.loss_fn"
) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss_fn``'s result as (the loss, its metrics by name): a scalar tensor, or
    ``(loss, {name: value})`` with exactly ``names`` (``Task.metrics``); errors name both."""
    extra: dict[str, float] = {}
    if isinstance(out, tuple):
        if len(out) != 2 or not isinstance(out[1], dict):
            raise LossFnError(f"{where}: must return a scalar tensor or (loss, {{name: value}}) "
                             f"(got a tuple of {len(out)})")  # fmt: skip
        out, got = out
        if tuple(sorted(got)) != tuple(sorted(names)):
            raise LossFnError(f"{where}: returned metrics {sorted(got)}, Task.metrics declares "
                             f"{sorted(names)}")  # fmt: skip
        for k, v in got.items():
            if isinstance(v, torch.Tensor) and v.numel() != 1:
                raise LossFnError(f"{where}: metric {k!r} must be a number or one-element "
                                 f"tensor (got shape {tuple(v.shape)})")  # fmt: skip
            extra[k] = float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
    elif names:
        raise LossFnError(f"{where}: Task.metrics declares {sorted(names)}, so it must return "
                         "(loss, {name: value}) (got the loss alone)")  # fmt: skip
    if not isinstance(out, torch.Tensor) or out.numel() != 1:
        kind = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise LossFnError(f"{where}: must return a scalar tensor (got {kind})")
    return out, extra
