"""A task's training recipe: its optimizer, its learning-rate schedule, and their identity.

Three things a user's recipe must be able to do without breaking the invariant:

- keep its own learning rates: the config's schedule (``optim.schedule``, warm-up) is a
  *factor* on each param group's initial rate, not a value written over it, so groups at
  1e-3 and 1e-4 stay 10:1 throughout;
- bring its own scheduler (``Task.make_scheduler``): then the scheduler alone sets the
  rates, it is stepped once per step, and its ``state_dict`` travels with the optimizer's
  (in checkpoints, under the key ``"scheduler"`` of the optimizer field, and in state
  copies to joiners), so a resume continues it bit for bit;
- be part of the run's identity: every param group's hyperparameters (minus the params
  themselves), the optimizer's and scheduler's classes and the scheduler's initial state are
  hashed into the config hash (``identity``), so a changed custom optimizer is a changed run.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from perdure.runtime.config import OptimConfig
from perdure.runtime.replica.task import Task, build_optimizer, lr_at

SCHEDULER_KEY = "scheduler"


class RecipeError(ValueError):
    """A recipe the config contradicts: ``field``, the ``rule`` and the ``value``."""

    def __init__(self, field: str, rule: str, value: object) -> None:
        super().__init__(f"{field}: {rule} (got {value})")
        self.field, self.rule, self.value = field, rule, value


class Recipe:
    """The optimizer and the learning-rate policy of one replica."""

    def __init__(self, task: Task, cfg: OptimConfig, total_steps: int) -> None:
        check_recipe(task, cfg)
        self.cfg, self.total_steps = cfg, total_steps
        self.optimizer = build_optimizer(task, cfg)
        self.base_lrs = [float(g["lr"]) for g in self.optimizer.param_groups]
        self.lrs: dict[str, float] = group_lrs(self.optimizer)
        """Each group's rate at the last ``set_lr`` (see :func:`group_lrs`)."""
        self.scheduler = task.make_scheduler(self.optimizer) if task.make_scheduler else None
        self.initial = identity_of(self.optimizer, self.scheduler, self.base_lrs)

    def set_lr(self, step: int) -> float:
        """Set each group's rate for ``step`` (unless the task's scheduler owns them);
        returns the first group's rate. ``lrs`` then holds every group's rate as the
        optimizer will use it at ``step`` (the scheduler's true value): the metrics'."""
        if self.scheduler is None:
            for group, base in zip(self.optimizer.param_groups, self.base_lrs, strict=True):
                group["lr"] = lr_at(step, self.cfg, self.total_steps, base)
        self.lrs = group_lrs(self.optimizer)
        return float(self.optimizer.param_groups[0]["lr"])

    def step(self) -> None:
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        """The optimizer's state, with the scheduler's under ``"scheduler"`` if any."""
        state = self.optimizer.state_dict()
        if self.scheduler is not None:
            state = {**state, SCHEDULER_KEY: self.scheduler.state_dict()}
        return state

    def load_state_dict(self, state: dict[str, Any], source: str = "the state") -> None:
        state = dict(state)
        sched = state.pop(SCHEDULER_KEY, None)
        if (sched is None) != (self.scheduler is None):
            has = "has" if sched is not None else "has no"
            want = "brings" if self.scheduler is not None else "has no"
            raise ValueError(
                f"{source}: its optimizer state {has} scheduler state, and the task {want} "
                "a scheduler (Task.make_scheduler)"
            )
        self.optimizer.load_state_dict(state)
        if self.scheduler is not None:
            self.scheduler.load_state_dict(sched)


def check_recipe(task: Task, cfg: OptimConfig) -> None:
    """A task's scheduler and the config's schedule would both set the rates: refuse."""
    if task.make_scheduler is None:
        return
    if cfg.schedule != "constant" or cfg.warmup_steps:
        rule = (
            "the task brings its own scheduler (Task.make_scheduler), which sets the learning "
            "rates: set optim.schedule = 'constant' and optim.warmup_steps = 0"
        )
        got = {"schedule": cfg.schedule, "warmup_steps": cfg.warmup_steps}
        raise RecipeError("optim.schedule", rule, got)


def identity_of(optimizer: Any, scheduler: Any, base_lrs: list[float]) -> dict[str, Any]:
    """What a run's recipe is, as plain data: classes and every group's hyperparameters
    (at their initial rates) and the scheduler's initial state."""
    groups = []
    for group, base in zip(optimizer.param_groups, base_lrs, strict=True):
        hyper = {k: plain(v) for k, v in sorted(group.items()) if k != "params"}
        groups.append({**hyper, "lr": base, "params": len(group["params"])})
    out: dict[str, Any] = {"optimizer": _qualname(optimizer), "param_groups": groups}
    if scheduler is not None:
        state = {k: plain(v) for k, v in sorted(scheduler.state_dict().items())}
        out["scheduler"] = {"class": _qualname(scheduler), "state": state}
    return out


def plain(value: Any) -> Any:
    """``value`` as JSON-able data that is the same in every process: tensors by value (or
    a digest when large), other objects by class name (never a memory address)."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.numel() <= 16:
            return plain(t.tolist())
        digest = hashlib.sha256(t.view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        return f"tensor:{t.dtype}:{list(t.shape)}:{digest[:16]}"
    return f"<{_qualname(value)}>"


def _qualname(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def group_lrs(optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Each param group's current rate, by the group's ``name`` (a key torch lets a group
    carry) or else its index: the ``lr/<group>`` metrics."""
    out = {}
    for i, group in enumerate(optimizer.param_groups):
        name = group.get("name")
        out[str(name) if isinstance(name, str) and name else str(i)] = float(group["lr"])
    return out
