"""A corrupt part is a storage fault, not data skew: it is repaired from a mirror with the
same bits, or the run stops before training on it, or (when chosen) it is quarantined as
``corrupt``; the non-finite classifier never blames the model for withheld samples."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest

from perdure import events as ev
from perdure.data import CorruptPartError, Dataset, PartError, SlotLoader
from perdure.events import read_jsonl
from perdure.launch.local import RunFailed
from tests.runtime_support import events, run_to_end, small_config

STEPS = 12
SEED = 1234  # train.seed's default: the data order of the runs below


def _copy_with_flip(src: Path, dst: Path, part: int) -> Path:
    """``src`` copied to ``dst`` with one byte of part ``part`` inverted."""
    shutil.copytree(src, dst)
    f = dst / f"shard-{part:05d}.bin"
    data = bytearray(f.read_bytes())
    data[len(data) // 3] ^= 0xFF
    f.write_bytes(bytes(data))
    return f


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _first_use(dataset: Path, part: int, *, batch: int = 16, slots: int = 8) -> dict:
    """The first step whose samples include ``part``, its slots and those samples."""
    with (
        Dataset.open(str(dataset)) as ds,
        SlotLoader(ds, seed=SEED, global_batch=batch, slots=slots, prefetch_steps=0) as loader,
    ):
        for t in range(1000):
            hit = {s: loader.samples(t, s) for s in range(slots)}
            hit = {s: ids[ds.part_of(ids) == part] for s, ids in hit.items()}
            hit = {s: ids for s, ids in hit.items() if ids.size}
            if hit:
                samples = sorted(int(i) for ids in hit.values() for i in ids)
                return {"step": t, "slots": sorted(hit), "samples": samples}
    raise AssertionError(f"part {part} unused in 1000 steps")


def _latest_part(dataset: Path, **batch: int) -> int:
    """The part first used latest (so that the steps before it can commit)."""
    n = len(list(dataset.glob("shard-*.bin")))
    return max(range(n), key=lambda k: _first_use(dataset, k, **batch)["step"])


@pytest.fixture(scope="module")
def clean(small_dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    rd = tmp_path_factory.mktemp("clean")
    return run_to_end(small_config(small_dataset, workers=2, steps=STEPS), rd)


# -- the store -------------------------------------------------------------------------------


def test_a_flipped_byte_is_served_from_the_first_mirror_with_the_manifests_bytes(
    small_dataset: Path, tmp_path: Path
) -> None:
    bad = _copy_with_flip(small_dataset, tmp_path / "primary", 3)
    wrong = _copy_with_flip(small_dataset, tmp_path / "bad-mirror", 3)  # corrupt as well
    mirrors = (str(tmp_path / "missing-mirror"), str(tmp_path / "bad-mirror"), str(small_dataset))
    with (
        Dataset.open(str(small_dataset)) as good,
        Dataset.open(
            str(tmp_path / "primary"), mirrors=mirrors, cache_dir=str(tmp_path / "cache")
        ) as ds,
    ):
        assert np.array_equal(ds.store.rows(3), good.store.rows(3))
        want = good.manifest.parts[3].sha256
        [repair] = ds.store.take_repairs()
        assert repair["part"] == 3 and repair["file"] == str(bad)
        assert repair["via"] == str(small_dataset)
        assert (repair["manifest"], repair["found"]) == (want, _sha(bad))
        assert repair["found"] == _sha(wrong) != want
        assert ds.store.take_repairs() == [] and ds.store.bad_parts() == {}


def test_with_no_good_copy_the_error_names_the_file_both_checksums_and_each_mirror(
    small_dataset: Path, tmp_path: Path
) -> None:
    bad = _copy_with_flip(small_dataset, tmp_path / "primary", 2)
    _copy_with_flip(small_dataset, tmp_path / "mirror", 2)
    with Dataset.open(str(tmp_path / "primary"), mirrors=(str(tmp_path / "mirror"),)) as ds:
        with pytest.raises(PartError) as e:
            ds.store.rows(2)
        want = ds.manifest.parts[2].sha256
        msg = str(e.value)
        assert str(bad) in msg and want in msg and _sha(bad) in msg
        assert f"no good copy in data.mirrors ({tmp_path / 'mirror'}: checksum mismatch" in msg
        assert e.value.found == _sha(bad)
        assert set(ds.store.bad_parts()) == {2} and ds.store.take_repairs() == []


def test_on_corrupt_stop_raises_from_the_read_before_any_sample_is_served(
    small_dataset: Path, tmp_path: Path
) -> None:
    bad = _copy_with_flip(small_dataset, tmp_path / "primary", 0)
    use = _first_use(tmp_path / "primary", 0)
    with (
        Dataset.open(str(tmp_path / "primary")) as ds,
        SlotLoader(
            ds, seed=SEED, global_batch=16, slots=8, prefetch_steps=0, on_corrupt="stop"
        ) as loader,
    ):
        with pytest.raises(CorruptPartError) as e:
            loader.batch(use["step"], use["slots"][0])
        msg = str(e.value)
        assert str(bad) in msg and ds.manifest.parts[0].sha256 in msg and _sha(bad) in msg
        assert "perdure data verify" in msg and f"at step {use['step']}" in msg


def test_an_injected_corruption_is_read_again_then_repaired_from_a_mirror(
    small_dataset: Path, tmp_path: Path
) -> None:
    """The ``corrupt_part`` fault: the primary copy reads corrupt from now on (re-read
    included), the mirror's copy is served, the file on disk is untouched."""
    before = _sha(small_dataset / "shard-00001.bin")
    mirror = tmp_path / "mirror"
    shutil.copytree(small_dataset, mirror)
    with Dataset.open(
        str(small_dataset), mirrors=(str(mirror),), cache_dir=str(tmp_path / "c")
    ) as ds:
        first = np.array(ds.store.rows(1))
        ds.store.inject_corrupt(1)
        assert np.array_equal(ds.store.rows(1), first)
        [repair] = ds.store.take_repairs()
        assert repair["via"] == str(mirror) and repair["found"] != repair["manifest"] == before
    assert _sha(small_dataset / "shard-00001.bin") == before


# -- runs ------------------------------------------------------------------------------------


def test_a_flipped_byte_with_a_good_mirror_ends_with_the_clean_runs_final_hash(
    clean: dict, small_dataset: Path, tmp_path: Path
) -> None:
    part = 3
    _copy_with_flip(small_dataset, tmp_path / "primary", part)
    cfg = small_config(
        tmp_path / "primary", workers=2, steps=STEPS, data={"mirrors": [str(small_dataset)]}
    )
    s = run_to_end(cfg, tmp_path / "run")
    assert s["final_hash"] == clean["final_hash"]
    repairs = events(tmp_path / "run", ev.PART_REPAIRED)
    assert repairs and {r["part"] for r in repairs} == {part}
    assert {r["via"] for r in repairs} == {str(small_dataset)}
    assert events(tmp_path / "run", ev.DECISION) == []


def test_with_no_mirror_the_run_stops_before_the_part_is_trained_on(
    small_dataset: Path, tmp_path: Path
) -> None:
    few = {"batch": 4, "slots": 4}  # a small batch: the part's first step comes later
    part = _latest_part(small_dataset, **few)
    bad = _copy_with_flip(small_dataset, tmp_path / "primary", part)
    use = _first_use(small_dataset, part, **few)
    cfg = small_config(tmp_path / "primary", workers=2, steps=STEPS, **few)
    assert 2 < use["step"] < STEPS
    with pytest.raises(RunFailed) as e:
        run_to_end(cfg, tmp_path / "run")
    msg = str(e.value)
    assert str(bad) in msg and _sha(small_dataset / bad.name) in msg and _sha(bad) in msg
    assert "perdure data verify" in msg and "Traceback" not in msg
    steps = {m["step"] for m in read_jsonl(tmp_path / "run" / "metrics.jsonl") if "loss" in m}
    assert steps == set(range(use["step"]))  # every step before it, none from it on
    assert len(events(tmp_path / "run", ev.RUN_FAILED)) == 1
    assert events(tmp_path / "run", ev.DECISION) == []


def test_on_corrupt_quarantine_records_a_decision_of_kind_corrupt(
    small_dataset: Path, tmp_path: Path
) -> None:
    part = 3
    bad = _copy_with_flip(small_dataset, tmp_path / "primary", part)
    use = _first_use(small_dataset, part)
    cfg = small_config(
        tmp_path / "primary", workers=2, steps=STEPS, data={"on_corrupt": "quarantine"}
    )
    run_to_end(cfg, tmp_path / "run")
    decisions = [
        {k: v for k, v in e.items() if k not in ("t", "event")}
        for e in events(tmp_path / "run", ev.DECISION)
    ]
    want = _sha(small_dataset / bad.name)
    reason = (
        f"no good copy (data.on_corrupt = 'quarantine'): part {part}: checksum mismatch "
        f"(manifest {want}, file {_sha(bad)}); no data.mirrors"
    )
    assert decisions == [
        {
            "step": use["step"],
            "kind": "corrupt",
            "parts": [part],
            "samples": use["samples"],
            "slots": use["slots"],
            "reason": reason,
        }
    ]


def test_a_one_part_dataset_whose_part_is_corrupt_never_blames_the_model(
    tmp_path: Path,
) -> None:
    """Quarantine leaves nothing to train on: the run stops naming the part, not the
    model or the optimizer (what a slot of withheld samples looked like before)."""
    from perdure.data import build_dataset
    from tests.runtime_support import STDLIB

    one = tmp_path / "one"
    build_dataset([str(STDLIB / "json")], str(one), seq_len=64, part_mb=64, include="*.py")
    assert len(list(one.glob("shard-*.bin"))) == 1
    bad = _copy_with_flip(one, tmp_path / "primary", 0)
    cfg = small_config(tmp_path / "primary", workers=2, steps=4, data={"on_corrupt": "quarantine"})
    with pytest.raises(RunFailed) as e:
        run_to_end(cfg, tmp_path / "run")
    msg = str(e.value)
    assert "parts [0]" in msg and str(bad) in msg and "leaves no part to train on" in msg
    assert "the model" not in msg and "non-finite" not in msg
