"""``Batch``: what one slot of one step hands to the training task."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Batch:
    """The samples of slot ``slot`` of step ``step``.

    ``weight`` is the per-sample loss weight: 1.0 normally, NaN for a sample whose part is
    poisoned (fault injection) or could not be read (``bad_parts``). The task multiplies
    per-sample losses by it, so such a slot's gradient is non-finite, exactly as bad data
    would make it, and the runtime's non-finite check attributes it to ``parts``.
    """

    step: int
    slot: int
    tokens: np.ndarray | None
    """int64 ``[B/S, seq_len + 1]``: the model reads ``[:, :-1]``, predicts ``[:, 1:]``.
    None for a dataset without a ``tokens`` field (images and labels: see ``fields``)."""
    sample_ids: np.ndarray
    """int64 ``[B/S]``: the served sample ids, after quarantine resampling."""
    positions: np.ndarray
    """int64 ``[B/S]``: the global order positions of this slot."""
    parts: np.ndarray
    """int64 ``[B/S]``: part of each sample."""
    weight: np.ndarray
    """float32 ``[B/S]``: loss weight per sample (see the class docstring)."""
    bad_parts: tuple[int, ...] = ()
    """Parts of this slot that failed to load (their rows are zero, weights NaN)."""
    fields: dict[str, np.ndarray] = field(default_factory=dict)
    """The dataset's other fields (``labels``, ``loss_mask``, ...) by name, ``[B/S, *shape]``
    each: integers as int64, floats in their stored dtype. Empty for a tokens-only dataset; every
    field of a dataset without tokens."""

    @property
    def finite(self) -> bool:
        return bool(np.isfinite(self.weight).all())
