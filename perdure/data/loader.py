"""``SlotLoader``: the samples and tokens of (step, slot), deterministic and random access.

``samples(step, slot)`` is a pure function of (seed, step, slot, global batch, slot count,
N, the quarantine in force at ``step``): any worker computing any slot at any time, with
any cache or prefetch history, gets the same ids. Reading them is the only I/O.

Bad parts (missing, unreadable, failing the checksum after a re-read and every mirror:
``data/store.py``) follow ``on_corrupt``. ``"stop"`` raises
:class:`~perdure.data.errors.CorruptPartError` from the read, so no sample of the part
reaches a gradient and the run ends naming the part file and both checksums.
``"quarantine"`` serves the rows as zeros with weight NaN (*withheld*: ``Batch.bad_parts``
says which), logs a warning once per part, puts the part in
:meth:`SlotLoader.pending_quarantine` and calls ``on_bad_part(part, reason)``. In a
multi-worker run the runtime turns the non-finite slot into a decision-log entry of kind
``corrupt`` that every worker applies at the same step (``loader.quarantine``); a worker
must not quarantine on its own, since the others would not know. ``auto_quarantine=True``
does it locally at once, for single-process use.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

from perdure.data.batch import Batch
from perdure.data.dataset import Dataset
from perdure.data.errors import CorruptPartError, DataError, PartError
from perdure.data.fields import TOKENS
from perdure.data.order import positions_to_samples
from perdure.data.prefetch import Prefetcher
from perdure.data.quarantine import Quarantine, QuarantineEntry
from perdure.data.slots import check_slots, slot_positions
from perdure.data.state import DataState

log = logging.getLogger("perdure.data")

BadPartCallback = Callable[[int, str], None]

ORDER_CHUNK = 8192
"""Order positions looked up per call (whole steps; at least one step)."""


class SlotLoader:
    """Slot-addressed loading of one dataset for one run (seed, global batch, slots)."""

    def __init__(
        self,
        dataset: Dataset,
        *,
        seed: int,
        global_batch: int,
        slots: int,
        quarantine: Quarantine | None = None,
        prefetch_steps: int = 1,
        on_bad_part: BadPartCallback | None = None,
        auto_quarantine: bool = False,
        wait_timeout_s: float = 60.0,
        document_fields: bool = False,
        on_corrupt: str = "quarantine",
    ) -> None:
        self.per_slot = check_slots(global_batch, slots)
        self.document_fields = document_fields
        """Add ``doc_ids`` and ``position_ids`` to every batch's fields (a dataset with
        document boundaries: a Megatron or MDS import; see ``Dataset.doc_fields``)."""
        if document_fields:
            dataset.documents()  # fails now, naming the dataset, if it has none
        if prefetch_steps < 0:
            raise DataError(f"loader: prefetch_steps must be >= 0 (got {prefetch_steps})")
        self.dataset, self.seed = dataset, seed
        self.global_batch, self.slots = global_batch, slots
        self.on_bad_part, self.auto_quarantine = on_bad_part, auto_quarantine
        if on_corrupt not in ("stop", "quarantine"):
            rule = "must be 'stop' or 'quarantine'"
            raise DataError(f"loader: on_corrupt {rule} (got {on_corrupt!r})")
        self.on_corrupt = on_corrupt
        """``data.on_corrupt``: a part with no good copy stops the read, or is withheld."""
        self.read_delay_s: Callable[[], float] = lambda: 0.0
        """Injected storage latency now in force, waited before each slot's read (the
        ``slow_storage`` fault; the prefetch hides it where it reads ahead)."""
        self._quarantine = quarantine or Quarantine()
        self._check_ids(self._quarantine)
        self._poisoned: set[int] = set()
        self._pending: list[QuarantineEntry] = []
        self._reported: set[int] = set()
        self._lock = threading.RLock()
        self._gen = 0
        self.prefetch_steps = prefetch_steps
        self._ids_cache: dict[int, tuple[Quarantine, np.ndarray]] = {}
        self._order_cache: dict[int, np.ndarray] = {}
        self._ids_cache_size = 2 * (prefetch_steps + 2)
        limit = max(1, prefetch_steps) * slots
        self._prefetcher = Prefetcher(self._load_tagged, limit, wait_timeout_s)

    @classmethod
    def from_state(cls, dataset: Dataset, state: DataState, *, slots: int, **kw: Any) -> SlotLoader:
        """A loader positioned by a checkpoint's data state (seed, batch, quarantine)."""
        _check_version(state, dataset.version_id)
        return cls(dataset, seed=state.seed, global_batch=state.global_batch, slots=slots,
                   quarantine=state.quarantine, **kw)  # fmt: skip

    # -- pure addressing ------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return self.dataset.num_samples

    @property
    def quarantine_list(self) -> Quarantine:
        return self._quarantine

    def positions(self, step: int, slot: int) -> np.ndarray:
        return slot_positions(step, slot, self.global_batch, self.slots)

    def samples(self, step: int, slot: int) -> np.ndarray:
        """Sample ids of (step, slot) after quarantine resampling (int64 ``[B/S]``)."""
        return self._samples(step, slot, self._quarantine)[1]

    def _samples(self, step: int, slot: int, q: Quarantine) -> tuple[np.ndarray, np.ndarray]:
        if step < 0 or not 0 <= slot < self.slots:
            self.positions(step, slot)  # raises the error naming the bad argument
        lo = slot * self.per_slot
        start = step * self.global_batch + lo
        pos = np.arange(start, start + self.per_slot, dtype=np.int64)
        return pos, self._step_samples(step, q)[lo : lo + self.per_slot]

    def _step_samples(self, step: int, q: Quarantine) -> np.ndarray:
        """Sample ids of the whole step, after quarantine, cached for a few steps."""
        with self._lock:
            hit = self._ids_cache.get(step)
        if hit is not None and hit[0] is q:
            return hit[1]
        ids = self._raw_step(step)
        active = q.active(step)
        if active:
            pos = slot_positions(step, 0, self.global_batch, 1)
            n = self.dataset.num_samples
            ids = active.resample(ids, pos, self.seed, n, self._part_of)
            ids.setflags(write=False)
        with self._lock:
            self._ids_cache[step] = (q, ids)
            while len(self._ids_cache) > self._ids_cache_size:
                self._ids_cache.pop(next(iter(self._ids_cache)))
        return ids

    def _raw_step(self, step: int) -> np.ndarray:
        """Order lookups (before quarantine) for a step, computed a chunk of steps at a time:
        a lookup's cost is mostly numpy call overhead, so one call for ``ORDER_CHUNK``
        positions costs little more than one for a slot's."""
        per_chunk = max(1, ORDER_CHUNK // self.global_batch)
        chunk, off = divmod(step, per_chunk)
        with self._lock:
            ids = self._order_cache.get(chunk)
        if ids is None:
            start = chunk * per_chunk * self.global_batch
            pos = np.arange(start, start + per_chunk * self.global_batch, dtype=np.int64)
            ids = positions_to_samples(self.seed, pos, self.dataset.num_samples)
            ids.setflags(write=False)
            with self._lock:
                self._order_cache[chunk] = ids
                while len(self._order_cache) > 2:
                    self._order_cache.pop(next(iter(self._order_cache)))
        return ids[off * self.global_batch : (off + 1) * self.global_batch]

    def _part_of(self, ids: np.ndarray) -> np.ndarray:
        return self.dataset.parts_unchecked(ids)

    # -- reading --------------------------------------------------------------------------

    def batch(self, step: int, slot: int) -> Batch:
        """Tokens and metadata of (step, slot); uses a valid prefetched batch if one exists."""
        got = self._prefetcher.take(step, slot, self._gen)
        if got is not None:
            return got
        return self._load_checked(step, slot)

    def prefetch(self, step: int, slots: Iterable[int]) -> None:
        """Start reading (step, slot) for ``slots`` in the background (bounded; no-op when
        ``prefetch_steps == 0``). Earlier steps' unread prefetches are dropped."""
        if self.prefetch_steps:
            self._prefetcher.submit(step, list(slots), self._gen)

    def _load_tagged(self, step: int, slot: int) -> Batch:
        return self._load_checked(step, slot)

    def _load_checked(self, step: int, slot: int) -> Batch:
        b = self._load(step, slot)
        if b.bad_parts and self.auto_quarantine:
            why = self.dataset.store.bad_parts()
            for k in b.bad_parts:
                self.quarantine([k], step, f"{why.get(k, 'unreadable')} (auto-quarantine)")
            with self._lock:
                self._pending = [e for e in self._pending if e.parts[0] not in b.bad_parts]
            b = self._load(step, slot)
        return b

    def _load(self, step: int, slot: int) -> Batch:
        with self._lock:
            q, poisoned = self._quarantine, frozenset(self._poisoned)
        pos, ids = self._samples(step, slot, q)
        parts = self._part_of(ids)
        stall = self.read_delay_s()
        if stall > 0:
            time.sleep(stall)
        values, bad = self.dataset.read_fields(ids, parts)
        if bad and self.on_corrupt == "stop":
            k = min(bad)
            raise CorruptPartError(bad[k], self.dataset.manifest.parts[k].sha256, step)
        if self.document_fields:
            values.update(self.dataset.doc_fields(ids))
        tokens = values.pop(TOKENS, None)  # None: a dataset without tokens
        weight = np.ones(ids.size, dtype=np.float32)
        hit = poisoned | bad.keys()
        if hit:
            weight[np.isin(parts, np.fromiter(hit, dtype=np.int64))] = np.nan
        if bad:
            self._report(bad, step)
        return Batch(step, slot, tokens, ids, pos, parts, weight, tuple(sorted(bad)), values)

    def _report(self, bad: dict[int, PartError], step: int) -> None:
        with self._lock:
            new = [k for k in sorted(bad) if k not in self._reported]
            self._reported.update(new)
            for k in new:
                self._pending.append(QuarantineEntry(step, (k,), (), bad[k].reason))
        for k in new:
            log.warning("data: %s; serving its samples with weight NaN and requesting "
                        "quarantine from step %d", bad[k], step)  # fmt: skip
            if self.on_bad_part is not None:
                self.on_bad_part(k, bad[k].reason)

    def pending_quarantine(self) -> list[QuarantineEntry]:
        """Quarantine requests for bad parts seen so far, cleared by this call. The runtime
        decides the step they apply from and calls :meth:`quarantine` on every worker."""
        with self._lock:
            out, self._pending = self._pending, []
        return out

    # -- decisions and faults -------------------------------------------------------------

    def quarantine(
        self, parts: list[int], step: int, reason: str, *, samples: Iterable[int] = ()
    ) -> Quarantine:
        """From ``step`` on, never serve ``parts`` (nor ``samples``); returns the new list."""
        with self._lock:
            q = self._quarantine.add(step, reason, parts=parts, samples=samples)
            self._check_ids(q)
            self._quarantine = q
            self._gen += 1
        self._prefetcher.invalidate()
        log.info("data: quarantined parts %s samples %s from step %d (%s)", sorted(parts),
                 sorted(samples), step, reason)  # fmt: skip
        return q

    def corrupt_part(self, part: int) -> None:
        """Fault injection: ``part``'s primary copy reads corrupt from now on (the store
        re-reads it, then repairs it from a mirror or withholds it); read-ahead made
        before is dropped, so every worker reads it afresh from the same step."""
        if not 0 <= part < self.dataset.num_parts:
            raise DataError(f"corrupt_part: part must be in [0, {self.dataset.num_parts}) "
                            f"(got {part})")  # fmt: skip
        with self._lock:
            self.dataset.store.inject_corrupt(part)
            self._gen += 1
        self._prefetcher.invalidate()

    def poison_part(self, part: int) -> None:
        """Fault injection: every sample of ``part`` gets loss weight NaN from now on."""
        if not 0 <= part < self.dataset.num_parts:
            raise DataError(f"poison_part: part must be in [0, {self.dataset.num_parts}) "
                            f"(got {part})")  # fmt: skip
        with self._lock:
            self._poisoned.add(part)
            self._gen += 1
        self._prefetcher.invalidate()

    def _check_ids(self, q: Quarantine) -> None:
        ns, n = self.dataset.num_parts, self.dataset.num_samples
        for e in q.entries:
            if any(not 0 <= s < ns for s in e.parts) or any(not 0 <= s < n for s in e.samples):
                raise DataError(f"quarantine: entry {e.to_dict()} names ids outside the "
                                f"dataset ({ns} parts, {n} samples)")  # fmt: skip

    # -- state ----------------------------------------------------------------------------

    def state(self, step: int) -> DataState:
        """The data offset to checkpoint when ``step`` is the next step to run."""
        return DataState(self.dataset.version_id, self.seed, step, self.global_batch,
                         self.dataset.num_samples, self._quarantine)  # fmt: skip

    def restore(self, state: DataState) -> int:
        """Adopt a checkpoint's quarantine; returns its step. O(1): nothing is replayed."""
        _check_version(state, self.dataset.version_id)
        for name in ("seed", "global_batch"):
            if getattr(state, name) != getattr(self, name):
                raise DataError(f"data state: {name} is {getattr(state, name)} but the loader's "
                                f"is {getattr(self, name)}")  # fmt: skip
        self._check_ids(state.quarantine)
        with self._lock:
            self._quarantine = state.quarantine
            self._gen += 1
        self._prefetcher.invalidate()
        return state.step

    def close(self) -> None:
        self._prefetcher.close()

    def __enter__(self) -> SlotLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_version(state: DataState, version_id: str) -> None:
    if state.version_id != version_id:
        raise DataError(
            f"data state: made for dataset version {state.version_id}, but the dataset "
            f"opened is version {version_id}"
        )
