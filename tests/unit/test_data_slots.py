from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest

from perdure.data import DataError, Dataset, DataState, SlotLoader, slot_positions
from tests.unit.test_data_support import copy_to_memory, make_dataset

B, S, SEED = 24, 6, 77


def _loader(url: str, **kw: object) -> SlotLoader:
    opts: dict = {"seed": SEED, "global_batch": B, "slots": S, **kw}
    return SlotLoader(Dataset.open(url, cache_dir=opts.pop("cache_dir", None)), **opts)


def test_slots_are_contiguous_pieces_of_the_steps_positions() -> None:
    got = np.concatenate([slot_positions(5, s, B, S) for s in range(S)])
    assert np.array_equal(got, np.arange(5 * B, 6 * B))


def test_consecutive_steps_cross_data_epoch_boundaries_without_gaps(tmp_path: Path) -> None:
    out, m = make_dataset(tmp_path)
    n = m.num_samples
    with _loader(str(out)) as loader:
        steps = -(-3 * n // B)
        ids = np.concatenate([loader.samples(t, s) for t in range(steps) for s in range(S)])
    for e in range(3):
        assert np.array_equal(np.sort(ids[e * n : (e + 1) * n]), np.arange(n))


def test_any_assignment_of_slots_to_workers_yields_the_same_samples(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    mem = copy_to_memory(out, "memory://slots-ds")
    steps = range(0, 40, 3)
    with _loader(str(out), prefetch_steps=0) as ref:
        expected = {(t, s): ref.batch(t, s) for t in steps for s in range(S)}
    rng = random.Random(5)
    for workers in (1, 2, 3, 5, 6):
        loaders = [
            _loader(mem if w % 2 else str(out), prefetch_steps=w % 3,
                    cache_dir=str(tmp_path / f"cache{workers}-{w}"))
            for w in range(workers)
        ]  # fmt: skip
        for t in steps:
            owner = [rng.randrange(workers) for _ in range(S)]  # a fresh plan every step
            for w, loader in enumerate(loaders):
                mine = [s for s in range(S) if owner[s] == w]
                loader.prefetch(t + rng.choice([0, 3]), mine)  # histories differ
                for s in rng.sample(mine, len(mine)):
                    b = loader.batch(t, s)
                    e = expected[(t, s)]
                    assert np.array_equal(b.sample_ids, e.sample_ids)
                    assert np.array_equal(b.tokens, e.tokens)
                    assert np.array_equal(b.parts, e.parts)
        for loader in loaders:
            loader.close()


def test_a_batch_holds_int64_tokens_and_metadata(tmp_path: Path) -> None:
    out, m = make_dataset(tmp_path)
    with _loader(str(out)) as loader:
        b = loader.batch(3, 2)
        assert b.tokens.dtype == np.int64 and b.tokens.shape == (B // S, m.seq_len + 1)
        assert np.array_equal(b.positions, slot_positions(3, 2, B, S))
        assert np.array_equal(b.tokens, loader.dataset.read(b.sample_ids).astype(np.int64))
        assert np.array_equal(b.parts, loader.dataset.part_of(b.sample_ids))
        assert b.weight.dtype == np.float32 and b.finite


def test_a_resume_at_a_random_step_gives_the_identical_next_batches(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    rng = random.Random(11)
    with _loader(str(out)) as run:
        run.quarantine([2], 4, "bad data")
        for _ in range(5):
            step = rng.randrange(0, 10**6)
            saved = json.dumps(run.state(step).to_dict())
            state = DataState.from_dict(json.loads(saved))
            with SlotLoader.from_state(Dataset.open(str(out)), state, slots=S) as resumed:
                for t in range(state.step, state.step + 3):
                    for s in range(S):
                        assert np.array_equal(run.batch(t, s).tokens, resumed.batch(t, s).tokens)


def test_a_resume_far_into_the_run_costs_the_same_as_at_step_zero(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    with _loader(str(out)) as loader:
        loader.batch(0, 0)
        start = time.perf_counter()
        state = loader.state(10**12)
        SlotLoader.from_state(loader.dataset, state, slots=S).batch(10**12, 0)
        assert time.perf_counter() - start < 0.5
        assert state.data_epoch == 10**12 * B // loader.num_samples


def test_a_state_for_another_dataset_version_is_an_error_naming_both(tmp_path: Path) -> None:
    out, m = make_dataset(tmp_path)
    other, m2 = make_dataset(tmp_path, name="other", seq_len=7)
    with _loader(str(out)) as loader:
        state = loader.state(5)
    ds2 = Dataset.open(str(other))
    with pytest.raises(DataError) as info:
        SlotLoader.from_state(ds2, state, slots=S)
    assert m.version_id in str(info.value) and m2.version_id in str(info.value)
    with pytest.raises(DataError, match=m2.version_id), _loader(str(other)) as l2:
        l2.restore(state)


def test_a_data_state_round_trips_through_json_and_rejects_bad_fields(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    with _loader(str(out)) as loader:
        loader.quarantine([1, 3], 2, "checksum", samples=[5])
        state = loader.state(9)
    d = json.loads(json.dumps(state.to_dict()))
    assert DataState.from_dict(d) == state
    assert d["position"] == 9 * B
    with pytest.raises(DataError, match="step must be an integer >= 0"):
        DataState.from_dict({**d, "step": -1})
    with pytest.raises(DataError, match=r"quarantine\.entries\[0\]\.parts"):
        DataState.from_dict({**d, "quarantine": {"entries": [{"step": 1, "parts": "x"}]}})


def test_bad_slot_arguments_are_errors(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    with pytest.raises(DataError, match="multiple of slots"):
        _loader(str(out), global_batch=10, slots=4)
    with _loader(str(out)) as loader, pytest.raises(DataError, match="0 <= slot < 6"):
        loader.samples(0, 6)
