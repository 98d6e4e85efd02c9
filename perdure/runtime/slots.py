"""One slot's forward and backward, with randomness derived only from (seed, step, slot).

The slot's gradient is flattened into a buffer laid out as ``[params | flags | losses]``:
``P`` gradient values, then S non-finite flags and S loss values, of which only this slot's
entries are set. Summed over slots by the reduction, the tail tells every replica which
slots were non-finite and what each slot's loss was, with no extra message.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from perdure.runtime.task import LossFn


def slot_seed(seed: int, step: int, slot: int) -> int:
    """A 63-bit seed that depends only on (seed, step, slot)."""
    digest = hashlib.blake2b(f"{seed}:{step}:{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def to_tensors(batch: object) -> dict[str, torch.Tensor]:
    """A loader batch (``tokens``, ``weight`` arrays) as torch tensors, zero-copy."""
    tokens = np.ascontiguousarray(batch.tokens, dtype=np.int64)  # type: ignore[attr-defined]
    weight = np.ascontiguousarray(batch.weight, dtype=np.float32)  # type: ignore[attr-defined]
    return {"tokens": torch.from_numpy(tokens), "weight": torch.from_numpy(weight)}


class SlotEngine:
    """Computes slot gradients of one model into flat buffers."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, seed: int, slots: int) -> None:
        self.model = model
        self.loss_fn = loss_fn
        self.seed = seed
        self.slots = slots
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in self.params)
        self.size = self.numel + 2 * slots

    def new_buffer(self) -> torch.Tensor:
        return torch.zeros(self.size, dtype=torch.float32)

    def compute(
        self,
        step: int,
        slot: int,
        batch: dict[str, torch.Tensor],
        out: torch.Tensor,
        seed_rng: Callable[[int], None] | None = None,
    ) -> float:
        """Fill ``out`` with slot ``slot`` of ``step``'s gradient; return the slot loss."""
        (seed_rng or _seed_all)(slot_seed(self.seed, step, slot))
        self.model.train()
        for p in self.params:
            p.grad = None
        loss = self.loss_fn(self.model, batch)
        loss.backward()
        offset = 0
        for p in self.params:
            n = p.numel()
            dst = out[offset : offset + n]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.reshape(-1))
            offset += n
        out[self.numel :].zero_()
        value = float(loss.detach())
        finite = bool(torch.isfinite(out[: self.numel]).all()) and np.isfinite(value)
        out[self.numel + slot] = 0.0 if finite else 1.0
        out[self.numel + self.slots + slot] = value if np.isfinite(value) else 0.0
        return value

    def assign_grads(self, flat: torch.Tensor, scale: float) -> None:
        """Point each parameter's ``.grad`` at ``flat[:P] * scale`` (in place)."""
        grads = flat[: self.numel]
        grads.mul_(scale)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad = grads[offset : offset + n].view_as(p)
            offset += n

    def bad_slots(self, flat: torch.Tensor) -> list[int]:
        flags = flat[self.numel : self.numel + self.slots]
        return [int(i) for i in torch.nonzero(flags).flatten()]

    def slot_losses(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.numel + self.slots :]


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)  # seeds the CPU generator and, where present, every CUDA one
