from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from perdure.data import DataError, Dataset, DataState, Quarantine, SlotLoader
from tests.unit.test_data_support import make_dataset

B, S, SEED = 16, 4, 3


def _loader(url: Path, **kw: object) -> SlotLoader:
    return SlotLoader(Dataset.open(str(url)), seed=SEED, global_batch=B, slots=S, **kw)  # type: ignore[arg-type]


def _served(loader: SlotLoader, steps: range) -> np.ndarray:
    return np.concatenate([loader.samples(t, s) for t in steps for s in range(S)])


def test_after_a_quarantine_no_sample_of_the_part_is_ever_served(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    with _loader(out) as loader:
        steps = range(0, 4 * loader.num_samples // B)
        assert 5 in loader.dataset.part_of(_served(loader, steps))
        loader.quarantine([5, 1], step=0, reason="test")
        lo, hi = loader.dataset.part_range(5)
        ids = _served(loader, steps)
        assert not np.isin(loader.dataset.part_of(ids), [1, 5]).any()
        batches = [loader.batch(t, s) for t in range(0, 60, 7) for s in range(S)]
        assert all(not np.isin(b.parts, [1, 5]).any() for b in batches)
        assert not np.isin(ids, np.arange(lo, hi)).any()


def test_a_quarantine_applies_from_its_step_and_changes_only_hit_positions(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    with _loader(out) as before, _loader(out) as after:
        after.quarantine([2], step=30, reason="late")
        for t in range(30):
            assert np.array_equal(before.samples(t, 1), after.samples(t, 1))
        for t in range(30, 60):
            a, b = before.samples(t, 1), after.samples(t, 1)
            hit = before.dataset.part_of(a) == 2
            assert np.array_equal(a[~hit], b[~hit])


def test_resampling_is_identical_across_workers_and_entry_orders(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    q1 = Quarantine().add(3, "a", parts=[4]).add(7, "b", parts=[0], samples=[50, 51])
    q2 = Quarantine().add(7, "b", samples=[51, 50], parts=[0]).add(3, "a", parts=[4])
    assert q1 == q2
    with _loader(out, quarantine=q1) as w1, _loader(out, quarantine=q2) as w2:
        for t in range(0, 200, 9):
            for s in (3, 0, 2):
                assert np.array_equal(w1.samples(t, s), w2.samples(t, s))
        served = _served(w1, range(7, 200))
        assert not np.isin(served, [50, 51]).any()


def test_resampling_survives_a_resume_through_the_data_state(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    with _loader(out) as run:
        run.quarantine([6], 12, "nan loss")
        state = DataState.from_dict(run.state(20).to_dict())
        with SlotLoader.from_state(Dataset.open(str(out)), state, slots=S) as resumed:
            for t in range(20, 80, 5):
                for s in range(S):
                    assert np.array_equal(run.batch(t, s).tokens, resumed.batch(t, s).tokens)
        fresh = _loader(out)
        fresh.restore(state)
        assert np.array_equal(_served(fresh, range(20, 40)), _served(run, range(20, 40)))


def test_a_poisoned_part_yields_nan_weights_until_quarantined(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    with _loader(out) as loader:
        b = loader.batch(1, 0)
        target = int(b.parts[0])
        loader.poison_part(target)
        poisoned = loader.batch(1, 0)
        assert np.array_equal(np.isnan(poisoned.weight), poisoned.parts == target)
        assert not poisoned.finite
        loader.quarantine([target], 1, "non-finite slot")
        clean = loader.batch(1, 0)
        assert clean.finite and target not in clean.parts


def test_a_part_failing_its_checksum_is_reported_and_served_as_nan(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out, _ = make_dataset(tmp_path)
    seen: list[tuple[int, str]] = []
    with _loader(out, on_bad_part=lambda k, why: seen.append((k, why))) as loader:
        b0 = loader.batch(0, 0)
        bad = int(b0.parts[0])
        loader.close()
    f = out / f"shard-{bad:05d}.bin"
    data = bytearray(f.read_bytes())
    data[3] ^= 0xFF
    f.write_bytes(bytes(data))
    with _loader(out, on_bad_part=lambda k, why: seen.append((k, why))) as loader:
        with caplog.at_level(logging.WARNING, logger="perdure.data"):
            b = loader.batch(0, 0)
        assert b.bad_parts == (bad,)
        assert np.array_equal(np.isnan(b.weight), b.parts == bad)
        assert seen == [(bad, seen[0][1])] and "checksum mismatch" in seen[0][1]
        assert f"shard-{bad:05d}.bin" in caplog.text and "checksum mismatch" in caplog.text
        pending = loader.pending_quarantine()
        assert [(e.step, e.parts) for e in pending] == [(0, (bad,))]
        assert loader.pending_quarantine() == []
        e = pending[0]
        loader.quarantine(list(e.parts), e.step, e.reason)
        assert loader.batch(0, 0).finite


def test_auto_quarantine_removes_a_bad_part_at_once(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    f = out / "shard-00002.bin"
    f.write_bytes(b"\x07" * f.stat().st_size)
    with _loader(out, auto_quarantine=True) as loader:
        batches = [loader.batch(t, s) for t in range(40) for s in range(S)]
        assert all(b.finite and 2 not in b.parts for b in batches)
        (entry,) = loader.quarantine_list.entries
        assert entry.parts == (2,) and "checksum" in entry.reason


def test_a_quarantine_json_round_trip_is_exact() -> None:
    q = Quarantine().add(5, "x", parts=[3, 1]).add(9, "y", samples=[7])
    assert Quarantine.from_dict(q.to_dict()) == q
    assert q.to_dict()["entries"][0] == {"step": 5, "parts": [1, 3], "samples": [], "reason": "x"}


def test_quarantining_everything_or_unknown_ids_is_an_error(tmp_path: Path) -> None:
    out, m = make_dataset(tmp_path)
    with _loader(out) as loader:
        with pytest.raises(DataError, match="outside the dataset"):
            loader.quarantine([len(m.parts)], 0, "x")
        loader.quarantine(list(range(len(m.parts))), 0, "all")
        with pytest.raises(DataError, match="nearly all"):
            loader.samples(0, 0)
