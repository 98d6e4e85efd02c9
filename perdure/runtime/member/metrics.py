"""A member's lines of metrics.jsonl: one per committed step, and the held-out evaluation's
when due (``evaluate.py``). None of it touches the math."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from perdure.data import Dataset
from perdure.data.retry import ReadPolicy
from perdure.run_config import RunConfig, resolve_path
from perdure.runtime.member.epoch import Epoch
from perdure.runtime.member.evaluate import EvalError, Evaluator, due, evaluate_logged
from perdure.runtime.replica.placement import Placement
from perdure.runtime.replica.trainer import MathError, Trainer


def step_line(
    trainer: Trainer, config: RunConfig, ep: Epoch, t: int, loss: float, step_s: float, name: str
) -> dict[str, Any]:
    """Step ``t``'s line. Every member writes the step it committed (the merger keeps one
    line per step): rank 0 alone would leave no line for a step it abandoned and the
    others kept."""
    tokens = trainer.tokens_per_step
    lrs = trainer.recipe.lrs  # the rates the optimizer used: a scheduler's own
    used = trainer.step_loss_scale  # fp16 only: the scale the step's gradient had
    return {
        "step": t,
        "loss": loss,
        "lr": next(iter(lrs.values()), None),
        **{f"lr/{group}": lr for group, lr in lrs.items()},
        "grad_norm": trainer.grad_norm,
        **outer_fields(config),
        **({} if used is None else {"loss_scale": used}),
        **{f"train/{k}": v for k, v in trainer.user_metrics.items()},
        "step_s": round(step_s, 6),
        "tokens_per_s": round(tokens / step_s, 1) if step_s > 0 and tokens else None,
        "membership_epoch": ep.number,
        "generation": ep.generation,
        "slots": ep.plan.counts(),
        "members": list(ep.plan.members),
        "worker": name,
    }


def outer_fields(config: RunConfig) -> dict[str, Any]:
    """With DiLoCo (``outer.replicas``) a step is an outer step: its loss is the replicas'
    mean inner loss and ``grad_norm`` the mean pseudo-gradient's norm; the line says so
    with the inner steps it stands for."""
    outer = config.outer
    return {"inner_steps": outer.inner_steps, "outer_lr": outer.lr} if outer.on else {}


class Evaluation:
    """The held-out evaluation (``[eval]``) of one member, its data opened at the first
    one that is due. Every member runs it, so that none waits for another at the next
    step's first collective (whose timeout a long evaluation would hit); rank 0 writes its
    line beside the steps'."""

    def __init__(self, config: RunConfig, run_dir: Path, placement: Placement, name: str):
        self.config, self.run_dir, self.placement, self.name = config, run_dir, placement, name
        self.evaluator: Evaluator | None = None

    def after(self, trainer: Trainer, t: int, write: Callable[[dict[str, Any]], None]) -> None:
        """After step ``t`` committed: the evaluation, when due. A failure stops the run
        (every replica would meet it), naming what failed."""
        if not due(self.config.eval, trainer.next_step):
            return
        try:
            if self.evaluator is None:
                self.evaluator = self._open(trainer)
            evaluate_logged(self.evaluator, t, write, self.name)
        except EvalError as e:
            raise MathError(str(e)) from None
        except Exception as e:  # the held-out data or the user's eval_fn: stop, naming it
            raise MathError(f"eval: {type(e).__name__}: {e}") from e

    def _open(self, trainer: Trainer) -> Evaluator:
        cfg = self.config
        dataset = Dataset.open(
            resolve_path(cfg, cfg.eval.dataset or ""),
            cache_dir=cfg.data.cache_dir or str(self.run_dir / "cache" / "eval"),
            cache_mb=cfg.data.cache_mb,
            policy=ReadPolicy(attempts=cfg.data.read_attempts, timeout_s=cfg.data.read_timeout_s),
        )
        return Evaluator(
            trainer.task,
            cfg.eval,
            dataset,
            seed=cfg.train.seed,
            precision=cfg.train.precision,
            device=self.placement.device,
        )

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()
