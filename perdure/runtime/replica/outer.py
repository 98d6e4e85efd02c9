"""DiLoCo's math on one replica: a virtual replica's inner steps, its pseudo-gradient, and
the outer step (Nesterov SGD on the mean pseudo-gradient). No network.

A perdure step is one *outer* step ``t``, and its S slots are the R virtual replicas
(``outer.replicas == train.slots``). Computing slot ``r`` runs replica ``r``'s H inner
steps from the outer parameters: inner step ``h`` is the synchronous run's step
``t * H + h`` restricted to slot ``r`` (its samples, its ``(seed, step, slot)``
randomness), with the task's own optimizer at the inner schedule's rate of that step.
The slot buffer then holds the pseudo-gradient ``theta_t - theta_r`` where a gradient
would be, and the exact reduction sums the R of them as integers, in any order, on any
membership (with ``outer.precision = "int8"`` every member instead gathers the R
pseudo-gradients as int8 (:func:`encode_int8`) and sums them in replica order:
``comm/int8_gather.py``). So a replica is a pure function of ``(theta_t, t, r)`` and the config: the
planner may place it on any member, move it to a survivor, or keep it across a failure
(``runtime/replica/salvage.py``), and not a bit changes.

Deviation from DiLoCo: its workers keep their inner AdamW state from one outer step to
the next; here every replica starts each outer step with a fresh inner optimizer state
(as DiLoCo's ablations and "streaming DiLoCo" note, a reset costs little at moderate H).
Kept state would be per-replica state that has to travel with the replica (a state copy
per move, R optimizer states in every checkpoint); a reset makes a replica need nothing
but the outer parameters, which every member already holds. Limits: the model's moving
buffers (BatchNorm statistics) are refused, a task's own scheduler is refused (it would
be stepped by whichever member ran a replica), and a non-finite pseudo-gradient stops the
run (the synchronous step's quarantine path re-runs slots of one step, not inner steps).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from perdure.runtime.config import OuterConfig
from perdure.runtime.replica.buffers import BufferRule
from perdure.runtime.replica.recipe import Recipe, RecipeError
from perdure.runtime.replica.slots import Progress, SlotEngine, all_finite, to_tensors

OUTER_KEY = "outer"
"""Beside the recipe's state in a checkpoint's optimizer field (and a state copy's): the
outer optimizer's state, ``{"momentum": float32 tensor [P]}`` in the slot buffer's
gradient order, and with ``outer.error_feedback`` the replicas' estimates,
``"estimates": float32 tensor [R, P]``, with ``outer.delay = 1`` the mean pseudo-gradient
not yet applied, ``"pending": float32 tensor [P]`` (:class:`OuterStep`)."""

INT8_MAX = 127


EXP_MIN, EXP_MAX = -127, 128
"""The block exponents an int8 record holds (one byte, ``e - 1``): float32's every normal
peak; a block whose peak is below ``2**-128`` (subnormal) is rounded against ``2**-134``."""


def encode_int8(values: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``values`` as int8 DiLoCo puts them on the wire: per block of ``block`` values, the
    exponent ``e`` of the block's largest magnitude (``m = f * 2**e`` with
    ``0.5 <= f < 1``; 0 for a block of zeros; at least :data:`EXP_MIN`) stored as the int8
    ``e - 1``, and each value as the int8 ``round(v / 2**(e - 7))`` (round-half-even,
    clamped to [-127, 127]; the peak lands in [64, 127]). Computed in float64, where
    ``2**(e - 7)`` never underflows, so the quotient is exact before its rounding. A pure
    function of the values: a replica's rounding does not depend on the others', so no
    exchange comes first. Returns ``(q int8 [n], e - 1 int8 [ceil(n / block)])``."""
    n = values.numel()
    pad = (-n) % block
    padded = torch.nn.functional.pad(values.detach().cpu().double(), (0, pad)).view(-1, block)
    _, exp = torch.frexp(padded.abs().amax(dim=1))
    exp = exp.clamp(EXP_MIN, EXP_MAX)
    step = torch.ldexp(torch.ones_like(padded[:, 0]), exp.double() - 7)
    q = torch.round(padded / step[:, None]).clamp_(-INT8_MAX, INT8_MAX)
    return q.view(-1)[:n].to(torch.int8), (exp - 1).to(torch.int8)


def decode_int8(q: torch.Tensor, exp: torch.Tensor, block: int) -> torch.Tensor:
    """:func:`encode_int8`'s values back, exactly, as float64 (``q * 2**(e - 7)``)."""
    n = q.numel()
    step = torch.ldexp(torch.ones(exp.numel(), dtype=torch.float64), exp.double() - 6)
    return (q.double() * step.repeat_interleave(block)[:n]).view(-1)


def quantize_int8(values: torch.Tensor, block: int) -> torch.Tensor:
    """``values`` rounded, in place, to what int8 DiLoCo's wire carries of them
    (:func:`encode_int8` then :func:`decode_int8`, as float32). Returns ``values``."""
    if values.numel():
        q, exp = encode_int8(values, block)
        values.copy_(decode_int8(q, exp, block).to(values.dtype))
    return values


def ef21_encode(
    delta: torch.Tensor, estimate: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One replica's record under EF21 (``outer.error_feedback``): :func:`encode_int8` of
    ``delta - estimate``, the difference taken in float64. Every member makes the new
    estimate from the record alone (:func:`ef21_update`), so it is the same bits
    everywhere."""
    return encode_int8(delta.detach().cpu().double() - estimate.double(), block)


def ef21_update(estimate: torch.Tensor, q: torch.Tensor, exp: torch.Tensor, block: int
                ) -> torch.Tensor:  # fmt: skip
    """A replica's new estimate from its old one and its record's int8 difference."""
    return (estimate.double() + decode_int8(q, exp, block)).to(torch.float32)


def check_outer(buffers: BufferRule, recipe: Recipe, replicas: int) -> None:
    """What DiLoCo cannot run (the workers' check and the launcher's preflight): raises
    :class:`RecipeError` naming the field, the rule and the value."""
    if buffers.numel:
        rule = (
            "cannot be set for a model whose forward moves buffers (BatchNorm statistics, "
            "counters): a virtual replica's inner steps would move them apart from the "
            "outer parameters (not built for DiLoCo)"
        )
        raise RecipeError("outer.replicas", rule, f"{replicas}; buffers {buffers.names[:4]}")
    if recipe.scheduler is not None:
        rule = (
            "cannot be set with a task that brings its own scheduler (Task.make_scheduler): "
            "the inner steps of whichever member runs a replica would step it; use "
            "optim.schedule instead (laid over train.steps x outer.inner_steps)"
        )
        raise RecipeError("outer.replicas", rule, replicas)


class OuterStep:
    """A replica's inner steps and the outer optimizer, over the trainer's own model,
    slot engine, inner recipe and loader (the inner steps run on the model in place and
    put the outer parameters back after)."""

    def __init__(
        self,
        cfg: OuterConfig,
        engine: SlotEngine,
        recipe: Recipe,
        batch: Callable[[int, int], Any],
        *,
        global_batch: int,
        grad_clip: float | None,
        prefetch: Callable[[int, int], None] = lambda step, slot: None,
    ) -> None:
        """``batch(step, slot)``: the loader's samples of a synchronous step's slot;
        ``prefetch(step, slot)``: read them ahead."""
        check_outer(engine.buffers, recipe, cfg.replicas)
        self.cfg, self.engine, self.recipe = cfg, engine, recipe
        self._batch, self._prefetch = batch, prefetch
        self.per_replica = global_batch // cfg.replicas
        self.grad_clip = grad_clip
        self.params = engine.params
        self.momentum = torch.zeros(engine.layout.numel, dtype=torch.float32)
        """The outer optimizer's momentum, in the gradient order of the slot buffer."""
        self.estimates: torch.Tensor | None = None
        """``outer.error_feedback``: every replica's EF21 estimate of its pseudo-gradient
        (float32 [R, P], zero at the start), moved by each outer step's int8 records
        (``comm/int8_gather.py``) and the same bits on every member: a function of the
        records on the wire alone, not of who computed which replica."""
        if cfg.error_feedback:
            self.estimates = torch.zeros(cfg.replicas, engine.layout.numel, dtype=torch.float32)
        self._staged: torch.Tensor | None = None
        self.pending: torch.Tensor | None = None
        """``outer.delay = 1``: the last outer step's mean pseudo-gradient, applied by the
        next one (zeros at the start: step 0 moves nothing)."""
        if cfg.delay:
            self.pending = torch.zeros(engine.layout.numel, dtype=torch.float32)
        self._undo: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        """While an overlapped outer step's reduction is in flight: the parameters (flat),
        the momentum and the pending mean before :meth:`apply_pending` (:meth:`undo`)."""
        self._scratch: torch.Tensor | None = None
        self._kept: dict[int, torch.Tensor] = {}
        """Replicas computed under ``_kept_key`` (see :meth:`replica`): one slot buffer
        each, so a member hosting k replicas holds k more buffers."""
        self._kept_key: tuple[int, int] | None = None
        self.norm = 0.0
        """The last outer step's mean pseudo-gradient norm (logged as ``grad_norm``)."""

    # -- one virtual replica ---------------------------------------------------------------

    def replica(
        self,
        step: int,
        r: int,
        out: torch.Tensor,
        abort: Callable[[], bool] = lambda: False,
        ready: Progress | None = None,
        key: tuple[int, int] | None = None,
    ) -> bool:
        """Fill ``out`` with replica ``r``'s pseudo-gradient of outer step ``step`` (and
        its flag, its mean inner loss and metrics in its slot's entries); False if aborted.
        On return the model holds the outer parameters again and the inner optimizer no
        state and its groups' initial rates: a member that ran a replica and one that did
        not (its slots salvaged) hold the same bits.

        ``key`` (the step and the trainer's state version): keep the result and copy it
        on a later call under the same key instead of running the inner steps again (a
        reduction with carried exponents computes a step twice when its prediction
        fails, the first step always, and a new epoch redoes the step in flight). A
        replica is a pure function of the state the key names, so a copy is its bits."""
        lay = self.engine.layout
        result = self._kept.get(r) if key is not None and key == self._kept_key else None
        if result is None:
            result = self._run(step, r, abort)
            if result is None:
                return False
            if key is not None:
                if key != self._kept_key:
                    self._kept, self._kept_key = {}, key
                self._kept[r] = result
        if ready is not None:
            ready.room(lay.size)
        out.copy_(result)
        if ready is not None:
            ready.advance(lay.size)
        return True

    def _run(self, step: int, r: int, abort: Callable[[], bool]) -> torch.Tensor | None:
        """Replica ``r``'s inner steps of outer step ``step``: a slot buffer of its own
        (see :meth:`replica`), or None if aborted."""
        lay = self.engine.layout
        if self._scratch is None:
            self._scratch = lay.new_buffer()
        out = lay.new_buffer()
        theta = self._flat()
        H = self.cfg.inner_steps
        loss = 0.0
        metrics = torch.zeros(lay.metrics, dtype=torch.float32, device=out.device)
        finite = True
        groups = self.recipe.optimizer.param_groups
        rates = [g["lr"] for g in groups]
        self.recipe.optimizer.state.clear()
        try:
            for h in range(H):
                if abort():
                    return None
                s = step * H + h
                if h + 1 < H:
                    self._prefetch(s + 1, r)
                finite = self._inner(s, r) and finite
                if not finite:
                    break
                loss += float(lay.losses(self._scratch)[r])
                metrics += lay.user_metrics(self._scratch)[:, r].to(metrics.device)
            grads = lay.grads(out)
            grads.copy_(theta.to(grads.device))
            grads.sub_(self._flat().to(grads.device))
            finite = finite and all_finite(grads)
        finally:  # the state as every member holds it between outer steps
            self._restore(theta)
            self.recipe.optimizer.state.clear()
            for g, lr in zip(groups, rates, strict=True):
                g["lr"] = lr
        if not finite:
            grads.zero_()
        lay.flags(out)[r] = 0.0 if finite else 1.0
        lay.losses(out)[r] = loss / H if finite else 0.0
        if lay.metrics:
            lay.user_metrics(out)[:, r] = metrics / H if finite else 0.0
        return out

    def _inner(self, s: int, r: int) -> bool:
        """Inner step ``s`` of replica ``r``: slot ``r`` of synchronous step ``s``, its
        mean gradient (clipped by ``optim.grad_clip``) and the inner optimizer's update at
        the schedule's rate of ``s``. False if the gradient was not finite (no update)."""
        buf = self._scratch
        assert buf is not None
        self.engine.compute(s, r, to_tensors(self._batch(s, r)), buf)
        if self.engine.layout.flags(buf)[r] != 0:
            return False
        self.engine.assign_grads(buf, self.per_replica)
        params = list(self.params)
        if self.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, self.grad_clip, foreach=False)
        self.recipe.set_lr(s)
        self.recipe.step()
        for p in params:
            p.grad = None
        return True

    def _flat(self) -> torch.Tensor:
        """The parameters, flat in the slot buffer's gradient order (a copy)."""
        return torch.cat([p.detach().reshape(-1).cpu() for p in self.params])

    def _restore(self, theta: torch.Tensor) -> None:
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.copy_(theta[offset : offset + n].view_as(p))
                p.grad = None
                offset += n

    # -- the outer step --------------------------------------------------------------------

    def stage_estimates(self, estimates: torch.Tensor) -> None:
        """The estimates this outer step's records give (``outer.error_feedback``):
        :meth:`apply` makes them current with its update; an abandoned step leaves them
        unused (its redo stages the same bits again)."""
        assert self.estimates is not None and estimates.shape == self.estimates.shape
        self._staged = estimates

    def apply(self, total: torch.Tensor) -> None:
        """The outer step from the reduced sum of the R pseudo-gradients (with
        ``outer.error_feedback``, of the R new estimates, staged with it): their mean
        ``d`` (an IEEE division by R), ``m = momentum * m + d``, and each parameter moved
        by ``-lr * (d + momentum * m)`` (torch's Nesterov SGD, on the flat buffer)."""
        if self.estimates is not None:
            assert self._staged is not None, "an error-feedback outer step without estimates"
            self.estimates, self._staged = self._staged, None
        d = self.mean(total)
        if self.pending is not None:  # outer.delay = 1: the previous step's mean now
            d, self.pending = self.pending, d
        self._move(d)

    def mean(self, total: torch.Tensor) -> torch.Tensor:
        """The mean pseudo-gradient of a reduced sum: an IEEE division by R, on the CPU."""
        return self.engine.layout.grads(total).cpu().div(self.cfg.replicas)

    def _move(self, d: torch.Tensor) -> None:
        """Nesterov SGD on the flat buffer: ``m = momentum * m + d``, each parameter moved
        by ``-lr * (d + momentum * m)``."""
        cfg = self.cfg
        self.norm = float(torch.linalg.vector_norm(d))
        self.momentum.mul_(cfg.momentum).add_(d)
        step = d.add(self.momentum, alpha=cfg.momentum)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                n = p.numel()
                p.add_(step[offset : offset + n].view_as(p).to(p.device), alpha=-cfg.lr)
                offset += n

    # -- the overlapped form of outer.delay = 1 ------------------------------------------------
    #
    # :meth:`apply` with ``outer.delay = 1`` takes step t's sum and applies step t - 1's
    # mean. Split in two, the same arithmetic lets step t's reduction run behind step t + 1's
    # replicas (``runtime/step.py``, ``OuterFlight``): :meth:`apply_pending` moves the
    # parameters by the mean already pending (step t - 1's) before step t's sum exists, and
    # :meth:`settle` makes step t's sum the pending mean once its reduction is done. Until
    # then :meth:`undo` can put the state back as it was before :meth:`apply_pending` (the
    # reduction was lost with a member: the step is redone from there).

    def apply_pending(self) -> None:
        """Outer step t's update under ``outer.delay = 1`` before step t's sum is known:
        the pending mean (step t - 1's) applied as :meth:`apply` applies it, the state
        before kept for :meth:`undo` (the parameters' flat copy and the momentum: two
        parameter copies while a reduction is in flight)."""
        assert self.pending is not None and self._undo is None, "no pending mean to apply"
        self._undo = (self._flat(), self.momentum.clone(), self.pending)
        d, self.pending = self.pending, None
        self._move(d)

    def settle(self, total: torch.Tensor) -> None:
        """Step t's reduced sum arrived (with ``outer.error_feedback``, the new estimates
        staged with it): its mean becomes the pending one, the estimates current."""
        assert self.pending is None and self._undo is not None, "no outer step in flight"
        if self.estimates is not None:
            assert self._staged is not None, "an error-feedback outer step without estimates"
            self.estimates, self._staged = self._staged, None
        self.pending, self._undo = self.mean(total), None

    def undo(self) -> None:
        """Step t's reduction was lost: the parameters, the momentum and the pending mean
        as they were before :meth:`apply_pending` (the estimates were not touched)."""
        assert self._undo is not None, "no outer step in flight"
        theta, self.momentum, self.pending = self._undo
        self._restore(theta)
        self._staged, self._undo = None, None

    @property
    def in_flight(self) -> bool:
        """An update applied whose step's reduction has not settled (see :meth:`settle`)."""
        return self._undo is not None

    # -- state -----------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        assert not self.in_flight, "the outer state read while a reduction is in flight"
        out = {"momentum": self.momentum.clone()}
        if self.estimates is not None:
            out["estimates"] = self.estimates.clone()
        if self.pending is not None:
            out["pending"] = self.pending.clone()
        return out

    def load(self, state: Any, source: str) -> None:
        """The outer state saved beside the recipe's (:data:`OUTER_KEY`); ``None`` (a
        checkpoint without it) is refused: it was not made by a DiLoCo run."""
        state = state if isinstance(state, dict) else {}
        self.momentum = _saved(
            state,
            "momentum",
            self.momentum.shape,
            source,
            "the outer optimizer's momentum (outer.replicas is set)",
        )
        self._staged, self._undo = None, None
        if self.cfg.delay:
            self.pending = _saved(
                state,
                "pending",
                self.momentum.shape,  # [P], as the momentum
                source,
                "the last outer step's mean pseudo-gradient (outer.delay = 1)",
            )
        if self.estimates is not None:
            self.estimates = _saved(
                state,
                "estimates",
                self.estimates.shape,
                source,
                "the replicas' error-feedback estimates (outer.error_feedback is set)",
            )


def _saved(state: dict[str, Any], key: str, shape: torch.Size, source: str, what: str) -> Any:
    """``state[key]``, a float32 tensor of ``shape``, copied to the CPU; else refused,
    naming the field, what it is and what was found."""
    t = state.get(key)
    if isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.shape == shape:
        return t.detach().cpu().clone()
    got = "none" if t is None else type(t).__name__
    if isinstance(t, torch.Tensor):
        got = f"{t.dtype} {list(t.shape)}"
    raise ValueError(
        f"{source}: optimizer.{OUTER_KEY}.{key} must be a float32 tensor of {list(shape)} "
        f"values, {what}; got {got}"
    )
