"""One slot's forward and backward, with randomness derived only from (seed, step, slot).

The slot's gradient is flattened into a buffer laid out by ``layout.GradLayout``: ``P``
gradient values, the moves of the model's buffers (``buffers.BufferRule``), then S
non-finite flags and S loss values, of which only this slot's entries are set.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch
from torch import nn

from perdure.runtime.replica.buffers import BufferRule
from perdure.runtime.replica.layout import BAD, OVERFLOW, GradLayout
from perdure.runtime.replica.task import LossFn, split_loss
from perdure.runtime.replica.user_rng import SlotRng


def slot_seed(seed: int, step: int, slot: int) -> int:
    """A 63-bit seed that depends only on (seed, step, slot)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def to_tensors(batch: object) -> dict[str, torch.Tensor]:
    """A loader batch (``tokens`` where the dataset has them, ``weight`` and the dataset's
    other ``fields``) as torch tensors by name, zero-copy: what the task's ``loss_fn``
    receives."""
    weight = np.ascontiguousarray(batch.weight, dtype=np.float32)  # type: ignore[attr-defined]
    out = {"weight": torch.from_numpy(weight)}
    if getattr(batch, "tokens", None) is not None:
        tokens = np.ascontiguousarray(batch.tokens, dtype=np.int64)  # type: ignore[attr-defined]
        out = {"tokens": torch.from_numpy(tokens), **out}
    for name, value in getattr(batch, "fields", {}).items():
        out[name] = torch.from_numpy(np.ascontiguousarray(value))
    return out


class SlotEngine:
    """Computes slot gradients of one model into flat buffers."""

    def __init__(
        self,
        model: nn.Module,
        loss_fn: LossFn,
        seed: int,
        slots: int,
        *,
        mean_loss: bool = False,
        precision: str = "fp32",
        buffers: torch.device | None = None,
        metrics: tuple[str, ...] = (),
    ) -> None:
        """``buffers``: the slot buffers' device (the data plane's; default the model's).
        ``metrics``: the task's own metric names (``Task.metrics``), in their order."""
        self.model = model
        self.loss_fn = loss_fn
        self.seed = seed
        self.slots = slots
        self.mean_loss = mean_loss
        """The task's loss is a mean over the slot's samples: scaled to a sum here."""
        self.buffers = BufferRule(model)
        self.rng = SlotRng(loss_fn, model)
        """The user's generators around each slot (``user_rng``)."""
        self.autocast = _autocast(model, precision)
        self.scale: float | None = 1.0 if precision == "fp16" else None
        """The loss scale the backward runs at (``replica/loss_scale.py``: the trainer sets
        it); None: no scale (``fp32``, ``bf16``), and a non-finite gradient is ``BAD``."""
        # Reversed: backward produces the last layers' gradients first, so the reduction can
        # stream the front of the buffer while the rest of the backward runs.
        self.params = [p for p in model.parameters() if p.requires_grad][::-1]
        self.offsets = [0]
        for p in self.params:
            self.offsets.append(self.offsets[-1] + p.numel())
        first = next(model.parameters(), None)
        self.device = first.device if first is not None else torch.device("cpu")
        where = buffers or self.device
        self.metrics = tuple(metrics)
        for name in self.metrics:
            if not isinstance(name, str) or not name.isidentifier() or name == "loss":
                raise ValueError(f"Task.metrics: each name must be an identifier other than "
                                 f"'loss' (got {name!r})")  # fmt: skip
        if len(set(self.metrics)) != len(self.metrics):
            raise ValueError(f"Task.metrics: names must be unique (got {list(self.metrics)})")
        self.layout = GradLayout(
            self.offsets[-1],
            slots,
            moves=self.buffers.numel,
            device=str(where),
            metrics=len(self.metrics),
        )
        self.numel = self.layout.numel
        self.size = self.layout.size
        self._finite = True
        """Whether every gradient of the slot being computed was finite."""

    def new_buffer(self) -> torch.Tensor:
        return self.layout.new_buffer()

    def compute(
        self,
        step: int,
        slot: int,
        batch: dict[str, torch.Tensor],
        out: torch.Tensor,
        seed_rng: Callable[[int], None] | None = None,
        ready: Progress | None = None,
    ) -> float:
        """Fill ``out`` with slot ``slot`` of ``step``'s gradient; return the slot loss.

        With ``ready``, each parameter's gradient is copied the moment backward has
        accumulated it, and ``ready`` learns how much of ``out`` is final: the reduction
        streams behind the backward instead of after it (the values are the same bits).
        """
        seed = slot_seed(self.seed, step, slot)
        with self.rng.slot(seed, step, slot):  # every generator the task reaches
            if seed_rng is not None:
                seed_rng(seed)
            return self._compute(slot, batch, out, ready)

    def _compute(
        self, slot: int, batch: dict[str, torch.Tensor], out: torch.Tensor, ready: Progress | None
    ) -> float:
        self.model.train()
        for p in self.params:
            p.grad = None
        self._finite = True
        done = [False] * len(self.params)
        hooks = [] if ready is None else self._hooks(out, done, ready)
        lay = self.layout
        saved = self.buffers.snapshot()
        moves = None
        try:
            loss, extra = self._loss(batch)
            (loss if self.scale is None else loss * self.scale).backward()
            moves = lay.buffer_moves(out)
        finally:
            for h in hooks:
                h.remove()
            self.buffers.record(saved, moves)
        if ready is not None:  # the writes below, past any hook: the whole window
            ready.room(self.size)
        for i, p in enumerate(self.params):
            if not done[i]:
                self._copy(i, p, out)
        lay.tail(out).zero_()
        value = float(loss.detach())
        # each gradient was checked as it was copied: a streaming reduction may already
        # have rewritten the buffer's front (non-finite values zeroed, integers in place)
        finite = self._finite and all_finite(lay.buffer_moves(out)) and np.isfinite(value)
        overflow = self.scale is not None and np.isfinite(value)  # the scale's, not the data's
        lay.flags(out)[slot] = 0.0 if finite else OVERFLOW if overflow else BAD
        lay.losses(out)[slot] = value if np.isfinite(value) else 0.0
        if self.metrics:
            column = lay.user_metrics(out)[:, slot]
            for i, name in enumerate(self.metrics):
                v = extra[name]
                column[i] = v if finite and math.isfinite(v) else 0.0
        if ready is not None:
            ready.advance(self.size)
        return value

    def _loss(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """The slot's loss as a sum over its samples (a mean is scaled by their count), and
        the task's metrics, scaled alike."""
        if self.device.type != "cpu":
            batch = {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}
        with self.autocast():
            loss, extra = split_loss(self.loss_fn(self.model, batch), self.metrics)
        loss = loss.float()
        if self.mean_loss:
            n = batch["weight"].shape[0]
            loss = loss * n
            extra = {k: float(np.float32(v) * np.float32(n)) for k, v in extra.items()}
        return loss, extra

    def _copy(self, i: int, p: torch.Tensor, out: torch.Tensor) -> None:
        """Parameter ``i``'s gradient into ``out``, then freed: with the hooks, a rank
        holds the slot buffer and the gradients the backward has not finished yet, never
        a second whole set of them (``optimizer in backward``'s pattern)."""
        dst = out[self.offsets[i] : self.offsets[i + 1]]
        if p.grad is None:
            dst.zero_()
        else:
            grad = p.grad.reshape(-1)
            self._finite = self._finite and all_finite(grad)
            dst.copy_(grad)
            p.grad = None

    def _hooks(self, out: torch.Tensor, done: list[bool], ready: Progress) -> list[Any]:
        """Post-accumulate hooks that copy each gradient as soon as it is final and advance
        the ready prefix of ``out`` (a parameter's gradient is final once: autograd sums
        every use of a leaf before accumulating it)."""
        state = {"next": 0}

        def hook_for(i: int) -> Callable[[torch.Tensor], None]:
            def hook(p: torch.Tensor) -> None:
                ready.room(self.offsets[i + 1])  # the reduction's window (Readiness)
                self._copy(i, p, out)
                done[i] = True
                while state["next"] < len(done) and done[state["next"]]:
                    state["next"] += 1
                ready.advance(self.offsets[state["next"]])

            return hook

        return [
            p.register_post_accumulate_grad_hook(hook_for(i)) for i, p in enumerate(self.params)
        ]

    def assign_grads(
        self, flat: torch.Tensor, batch: float, own: tuple[int, int] | None = None
    ) -> None:
        """Point each parameter's ``.grad`` at ``flat[:P] / batch`` (in place): the slot
        losses are sums over samples, so this is the gradient of the mean loss (``batch``:
        B, or B times the loss scale under ``fp16``). A division,
        not a multiplication by ``1 / batch``, which is inexact for most batch sizes.
        ``own``: the value range that holds the sum (a reduce-scatter's: the rest is the
        local partial, which is neither divided nor read, so its pages stay untouched)."""
        grads = self.layout.grads(flat)
        lo, hi = own if own is not None else (0, grads.numel())
        grads[lo:hi].div_(batch)  # IEEE division: the same bits on either device
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = grads[offset : offset + n].view_as(p).to(p.device)  # a view on one device
            offset += n

    def apply_buffers(self, flat: torch.Tensor) -> None:
        """Move the model's buffers by the step's reduced buffer moves (``BufferRule``)."""
        self.buffers.apply(self.layout.buffer_moves(flat), self.slots)

    def bad_slots(self, flat: torch.Tensor) -> list[int]:
        return self.layout.bad_slots(flat)

    def slot_losses(self, flat: torch.Tensor) -> torch.Tensor:
        return self.layout.losses(flat)

    def step_metrics(self, flat: torch.Tensor, batch: int) -> dict[str, float]:
        """The task's metrics of a reduced buffer: each one's slot values summed in slot
        order over the global batch, as the loss (``Trainer.apply``)."""
        rows = self.layout.user_metrics(flat)
        return {name: float(rows[i].sum()) / batch for i, name in enumerate(self.metrics)}


class Progress(Protocol):
    """Told how much of a slot buffer is final, and asked for room before a gradient is
    written into it (see ``comm.readiness.Readiness``)."""

    def advance(self, upto: int) -> None: ...

    def room(self, upto: int) -> None: ...


def all_finite(x: torch.Tensor) -> bool:
    """Whether every element of ``x`` is finite, in one read-only pass in the common case.

    A finite sum implies finite elements (a NaN or an infinity makes the sum NaN or
    infinite), and ``sum`` is one vectorised pass, where ``isfinite(x).all()`` writes a
    mask and is ~40x slower on CPU here (~100 ms for 11M elements, against ~3 ms: see
    docs/performance.md). Only a non-finite sum, which finite elements can also give by
    overflow, pays for the exact elementwise test.
    """
    return math.isfinite(float(x.sum())) or bool(torch.isfinite(x).all())


AUTOCAST = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``train.precision``'s autocast dtypes (``fp32``: none)."""


def autocast_for(device: torch.device | str, precision: str) -> Callable[[], Any]:
    """A context factory for a forward: autocast to ``precision``'s dtype on ``device``'s
    type, nothing for ``fp32`` (the slots' and the evaluation's alike)."""
    if precision == "fp32":
        return contextlib.nullcontext
    if precision not in AUTOCAST:
        raise ValueError(f"train.precision: must be 'fp32', 'bf16' or 'fp16' (got {precision!r})")
    kind = torch.device(device).type
    return lambda: torch.autocast(device_type=kind, dtype=AUTOCAST[precision])


def _autocast(model: nn.Module, precision: str) -> Callable[[], Any]:
    """:func:`autocast_for` on the model's device."""
    first = next(model.parameters(), None)
    return autocast_for(first.device if first is not None else "cpu", precision)
