"""Quarantine: parts and samples that are never served again, and their resampling.

An entry (step, parts, samples, reason) applies from its step on: the batch of step ``t``
sees the entries with ``step <= t``. Steps before it are untouched, so a run replayed from
an older checkpoint with the same decision log reproduces every batch.

A quarantined sample at global position ``p`` is replaced by the first candidate
``c_a = H(seed, p, a) mod N``, ``a = 1, 2, ...``, that is not itself quarantined
(``H`` is a keyed splitmix64 hash). So the replacement is a pure function of
(seed, position, attempt, quarantine list); adding an entry changes only the positions
whose sample or replacement it hits; the entries' order does not matter (the list is a
set), so workers that learn of entries in different orders still agree.
Limit: resampling gives up (DataError) after :data:`MAX_ATTEMPTS` attempts at a position,
which needs almost all samples quarantined.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from perdure.data.errors import DataError
from perdure.data.hashing import derive_keys, mix64

MAX_ATTEMPTS = 1000


@dataclass(frozen=True, order=True)
class QuarantineEntry:
    """One decision: from ``step`` on, never serve these parts or sample ids."""

    step: int
    parts: tuple[int, ...] = ()
    samples: tuple[int, ...] = ()
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"step": self.step, "parts": list(self.parts), "samples": list(self.samples),
                "reason": self.reason}  # fmt: skip

    @classmethod
    def from_dict(cls, d: object, where: str = "quarantine entry") -> QuarantineEntry:
        if not isinstance(d, dict):
            raise DataError(f"{where}: must be an object (got {d!r})")
        step: Any = d.get("step")
        reason: Any = d.get("reason", "")
        if not _is_int(step) or step < 0:
            raise DataError(f"{where}.step: must be an integer >= 0 (got {step!r})")
        if not isinstance(reason, str):
            raise DataError(f"{where}.reason: must be a string (got {reason!r})")
        key = "parts" if "parts" in d or "shards" not in d else "shards"  # shards: older
        parts = _ids(d.get(key, []), f"{where}.{key}")
        samples = _ids(d.get("samples", []), f"{where}.samples")
        return cls(step, parts, samples, reason)


@dataclass(frozen=True)
class Quarantine:
    """An immutable set of entries; :meth:`add` returns a new quarantine."""

    entries: tuple[QuarantineEntry, ...] = ()

    def __post_init__(self) -> None:  # canonical order: equal sets compare and hash equal
        object.__setattr__(self, "entries", tuple(sorted(set(self.entries))))

    def add(
        self, step: int, reason: str, *, parts: Iterable[int] = (), samples: Iterable[int] = ()
    ) -> Quarantine:
        entry = QuarantineEntry(int(step), _norm(parts), _norm(samples), reason)
        if entry.step < 0 or not (entry.parts or entry.samples):
            raise DataError(f"quarantine: entry needs step >= 0 and some ids (got {entry})")
        return Quarantine((*self.entries, entry))

    def active(self, step: int) -> ActiveQuarantine:
        """The entries that apply to the batch of ``step``."""
        return ActiveQuarantine(tuple(e for e in self.entries if e.step <= step))

    def to_dict(self) -> dict[str, Any]:
        return {"entries": [e.to_dict() for e in self.entries]}

    @classmethod
    def from_dict(cls, d: object) -> Quarantine:
        if not isinstance(d, dict) or not isinstance(d.get("entries"), list):
            raise DataError(f"quarantine: must be an object with an 'entries' list (got {d!r})")
        es = d["entries"]
        return cls(tuple(QuarantineEntry.from_dict(e, f"quarantine.entries[{i}]")
                         for i, e in enumerate(es)))  # fmt: skip

    def __len__(self) -> int:
        return len(self.entries)


@dataclass(frozen=True)
class ActiveQuarantine:
    """The quarantine in force at one step: membership tests and resampling."""

    entries: tuple[QuarantineEntry, ...]

    @cached_property
    def parts(self) -> np.ndarray:
        return np.array(sorted({s for e in self.entries for s in e.parts}), dtype=np.int64)

    @cached_property
    def samples(self) -> np.ndarray:
        return np.array(sorted({s for e in self.entries for s in e.samples}), dtype=np.int64)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def mask(self, ids: np.ndarray, part_of: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """True where a sample id is quarantined (its part or itself)."""
        bad = np.zeros(ids.shape, dtype=bool)
        if self.parts.size:
            bad |= np.isin(part_of(ids), self.parts)
        if self.samples.size:
            bad |= np.isin(ids, self.samples)
        return bad

    def resample(
        self,
        ids: np.ndarray,
        positions: np.ndarray,
        seed: int,
        n: int,
        part_of: Callable[[np.ndarray], np.ndarray],
    ) -> np.ndarray:
        """``ids`` with each quarantined one replaced by its position's first clean
        candidate; pure in (seed, positions, attempt, this quarantine)."""
        out = np.array(ids, dtype=np.int64, copy=True)
        todo = np.flatnonzero(self.mask(out, part_of))
        attempt = 0
        while todo.size:
            attempt += 1
            if attempt > MAX_ATTEMPTS:
                raise DataError(
                    f"quarantine: no clean sample for positions {positions[todo][:4].tolist()} "
                    f"after {MAX_ATTEMPTS} attempts; nearly all of the {n} samples are quarantined"
                )
            out[todo] = resample_candidates(seed, positions[todo], attempt, n)
            todo = todo[self.mask(out[todo], part_of)]
        return out


def resample_candidates(seed: int, positions: np.ndarray, attempt: int, n: int) -> np.ndarray:
    """Candidate sample ids ``H(seed, position, attempt) mod n`` (vectorised, pure)."""
    k1, k2 = derive_keys("perdure.resample.v1", 2, seed)
    x = np.asarray(positions, dtype=np.int64).astype(np.uint64) ^ np.uint64(k1)
    x = mix64(mix64(x) ^ (np.uint64(k2) + np.uint64(attempt)))
    return (x % np.uint64(n)).astype(np.int64)


def _norm(ids: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted({int(i) for i in ids}))


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ids(v: object, where: str) -> tuple[int, ...]:
    if not isinstance(v, list) or not all(_is_int(i) and i >= 0 for i in v):
        raise DataError(f"{where}: must be a list of integers >= 0 (got {v!r})")
    return _norm(v)  # type: ignore[arg-type]
