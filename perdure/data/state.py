"""``DataState``: the data offset of a checkpoint, small and JSON.

It pins everything the loader needs to produce step ``step`` and every later one: the
dataset version, the seed, the global batch (positions are ``step * global_batch``), and
the quarantine list. ``step`` is the first step *not yet consumed*; ``data_epoch`` and
``position`` are derived, stored for people and for other readers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from perdure.data.errors import DataError
from perdure.data.quarantine import Quarantine

STATE_VERSION = 1


@dataclass(frozen=True)
class DataState:
    """Where the data stream stands; restoring it costs O(1) (no replay of the stream)."""

    version_id: str
    seed: int
    step: int
    global_batch: int
    num_samples: int
    quarantine: Quarantine = field(default_factory=Quarantine)

    @property
    def position(self) -> int:
        """Global order position of the first sample of ``step``."""
        return self.step * self.global_batch

    @property
    def data_epoch(self) -> int:
        """Data epoch (pass over the data) that ``position`` falls in."""
        return self.position // self.num_samples

    def to_dict(self) -> dict[str, Any]:
        return {
            "state_version": STATE_VERSION,
            "version_id": self.version_id,
            "seed": self.seed,
            "step": self.step,
            "global_batch": self.global_batch,
            "num_samples": self.num_samples,
            "position": self.position,
            "data_epoch": self.data_epoch,
            "quarantine": self.quarantine.to_dict(),
        }

    @classmethod
    def from_dict(cls, d: object, source: str = "data state") -> DataState:
        """Parse; raise DataError naming ``source``, the field, the rule and the value."""
        if not isinstance(d, dict):
            raise DataError(f"{source}: must be an object (got {type(d).__name__})")
        if d.get("state_version") != STATE_VERSION:
            raise DataError(
                f"{source}: state_version must be {STATE_VERSION} (got {d.get('state_version')!r})"
            )
        vid = d.get("version_id")
        if not isinstance(vid, str) or not vid:
            raise DataError(f"{source}: version_id must be a non-empty string (got {vid!r})")
        ints = {k: d.get(k) for k in ("seed", "step", "global_batch", "num_samples")}
        for k, v in ints.items():
            low = 1 if k in ("global_batch", "num_samples") else 0 if k == "step" else None
            ok = isinstance(v, int) and not isinstance(v, bool) and (low is None or v >= low)
            if not ok:
                raise DataError(f"{source}: {k} must be an integer >= {low} (got {v!r})")
        try:
            q = Quarantine.from_dict(d.get("quarantine", {"entries": []}))
        except DataError as e:
            raise DataError(f"{source}: {e}") from None
        return cls(vid, ints["seed"], ints["step"], ints["global_batch"],  # type: ignore[arg-type]
                   ints["num_samples"], q)  # type: ignore[arg-type]  # fmt: skip
