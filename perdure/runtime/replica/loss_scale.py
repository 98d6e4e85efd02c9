"""The deterministic dynamic loss scale of ``train.precision = "fp16"``.

float16 keeps 5 exponent bits: a gradient below ~6e-8 flushes to zero, one above 65504
overflows. As torch's ``GradScaler`` does, the loss is multiplied by a scale S before the
backward, so that small gradients stay representable, and the step's reduced gradient sum
is divided by S before clipping and the optimizer; S is a power of two, so both are exact
(the division rounds only where the quotient is subnormal in float32).

What differs from ``GradScaler`` is where the decisions come from. Here each one is a
function of the step's reduced slot flags only (``layout.OVERFLOW``: a slot whose loss is
finite and whose gradient is not), which every member reads identically from the exact
sum, so the scale follows the same trajectory on any membership, and across a resume (the
state below is in every checkpoint and state copy):

- an overflow at scale S makes the scale ``S * backoff_factor`` and **the step is computed
  again** at the new scale. ``GradScaler`` skips the step instead (its optimizer step is a
  no-op and the batch is dropped). Here a skip would drop the step's samples from the data
  trajectory, and the data of a step is a function of its number (``SlotLoader``): the
  skipped samples would be lost for good, where a recompute trains on every sample at the
  cost of one more forward and backward of the step (overflows are rare: about one per
  ``growth_interval`` steps once the scale has settled);
- after ``growth_interval`` applied steps in a row without an overflow, the scale is
  multiplied by ``growth_factor`` for the next step (the step that was computed again
  after an overflow counts as the first of them, as the first step after a skip does in
  ``GradScaler``);
- an overflow at ``min_scale`` cannot be cured by scaling: the run stops
  (``MathError``), since the alternatives would blame a worker or quarantine data for what
  is float16's range.

Limit: the streamed exact reduction's carried exponents are predicted from the previous
step's gradient, which a growth doubles: the first step after a growth may miss the
prediction and be computed twice (``exponents_refit``), as after any jump in the gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from perdure.runtime.config import TrainConfig

BACKED_OFF = "overflow"
GREW = "growth"
"""The two reasons a scale changes (``loss_scale`` events)."""

MAX_SCALE = 2.0**64
"""The scale never grows past this (``train.loss_scale_init``'s bound)."""

LOSS_SCALE_KEY = "loss_scale"
"""Beside the recipe's state in a checkpoint's optimizer field: ``{"scale": float,
"clean": int}`` under ``fp16``; absent otherwise."""


@dataclass(frozen=True)
class ScaleRule:
    """The config's scale policy (``train.loss_scale_*``)."""

    init: float
    growth_interval: int
    growth_factor: float
    backoff_factor: float
    min_scale: float

    @classmethod
    def of(cls, train: TrainConfig) -> ScaleRule | None:
        """The rule of a run, or None: the loss is scaled under ``fp16`` only."""
        if train.precision != "fp16":
            return None
        return cls(
            init=float(train.loss_scale_init),
            growth_interval=train.loss_scale_growth_interval,
            growth_factor=float(train.loss_scale_growth_factor),
            backoff_factor=float(train.loss_scale_backoff_factor),
            min_scale=float(train.loss_scale_min),
        )

    def initial(self) -> LossScale:
        return LossScale(scale=self.init, clean=0)


@dataclass(frozen=True)
class LossScale:
    """The scale's state: part of the run's state, like the optimizer's."""

    scale: float
    clean: int
    """Applied steps in a row without an overflow since the scale last changed."""

    def backed_off(self, rule: ScaleRule) -> LossScale | None:
        """After an overflow: the smaller scale, or None at the floor."""
        if self.scale <= rule.min_scale:
            return None
        return LossScale(scale=max(self.scale * rule.backoff_factor, rule.min_scale), clean=0)

    def applied(self, rule: ScaleRule) -> LossScale:
        """After a step is applied (without an overflow at its final scale): one more
        clean step, and the grown scale once there are ``growth_interval`` of them."""
        clean = self.clean + 1
        if clean >= rule.growth_interval:
            return LossScale(scale=min(self.scale * rule.growth_factor, MAX_SCALE), clean=0)
        return LossScale(scale=self.scale, clean=clean)

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "clean": self.clean}

    @classmethod
    def from_dict(cls, d: Any, rule: ScaleRule, source: str) -> LossScale:
        """A saved state, checked: a scale the rule could have reached, a count below the
        growth interval."""
        scale = d.get("scale") if isinstance(d, dict) and set(d) == {"scale", "clean"} else None
        clean = d.get("clean") if scale is not None else None
        ok = type(clean) is int and 0 <= clean < rule.growth_interval
        ok = ok and isinstance(scale, float) and rule.min_scale <= scale <= MAX_SCALE
        ok = ok and isinstance(scale, float) and math.frexp(scale)[0] == 0.5  # 2**k
        if not ok:
            raise ValueError(
                f"{source}: optimizer.{LOSS_SCALE_KEY} must be {{'scale': a power of two >= "
                f"train.loss_scale_min ({rule.min_scale!r}), 'clean': an integer in [0, "
                f"train.loss_scale_growth_interval ({rule.growth_interval}))}} under "
                f"train.precision = 'fp16' (got {d!r:.80})"
            )
        assert isinstance(scale, float) and isinstance(clean, int)
        return cls(scale=scale, clean=clean)


def scale_event(step: int, old: float, new: float, reason: str, slots: list[int]) -> dict[str, Any]:
    """The ``loss_scale`` event of a change (``slots``: the overflowing ones)."""
    out: dict[str, Any] = {"step": step, "old": old, "new": new, "reason": reason}
    if slots:
        out["slots"] = slots
    return out
