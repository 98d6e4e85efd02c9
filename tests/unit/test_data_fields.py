"""Named per-sample fields in the format: manifest version 2 round-trips and is validated,
fields stream and degrade like tokens, and a tokens-only dataset is what it always was."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from perdure.data import DataError, Dataset, SlotLoader
from perdure.data.fields import Field, FieldSpec
from perdure.data.importer import import_arrays
from perdure.runtime.replica.slots import to_tensors
from tests.unit.test_data_support import copy_to_memory, make_dataset

TINY_VERSION_ID = "sha256:10ab8a1f1fcfee22144a315434ef72bc452b7c9ed94a8af6ba58978dfcf47ce4"
TINY_MANIFEST_SHA256 = "a88a096076e996a60a1cde558337bbcd6adc7d0e200fc779263612459c2508c1"
"""tests.unit.test_data_support.make_dataset's, as built before fields existed (commit 3cd0df0),
when the part files were listed under ``shards``."""


def test_the_tiny_tokens_only_dataset_keeps_its_version_id_and_its_old_manifest_loads(
    tmp_path: Path,
) -> None:
    out, m = make_dataset(tmp_path)
    assert m.version_id == TINY_VERSION_ID and m.format_version == 1
    written = json.loads((out / "manifest.json").read_text())
    assert "shards" not in written and [p["file"] for p in written["parts"]] == [
        f"shard-{k:05d}.bin" for k in range(len(m.parts))
    ]
    old = dict(written)
    old["shards"] = old.pop("parts")
    text = json.dumps(old, indent=2, sort_keys=True) + "\n"
    assert hashlib.sha256(text.encode()).hexdigest() == TINY_MANIFEST_SHA256  # only the key moved
    (out / "manifest.json").write_text(text)
    with Dataset.open(str(out)) as ds, SlotLoader(ds, seed=0, global_batch=8, slots=2) as ld:
        assert ds.manifest == m and ds.version_id == TINY_VERSION_ID
        b = ld.batch(0, 0)
        assert b.fields == {} and set(to_tensors(b)) == {"tokens", "weight"}


def _two_fields(tmp: Path, name: str = "ds") -> Path:
    n = 24 * 16
    (tmp / "t.bin").write_bytes((np.arange(n) % 251).astype("<u2").tobytes())
    np.save(tmp / "m.npy", (np.arange(n) % 2).astype(np.float32).reshape(24, 16))
    import_arrays(
        {"tokens": [str(tmp / "t.bin")], "loss_mask": [str(tmp / "m.npy")]},
        str(tmp / name),
        seq_len=15,
        dtype="uint16",
        part_mb=5 * 80 / (1 << 20),
    )
    return tmp / name


def _edit(out: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = out / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_a_fields_manifest_round_trips_and_declares_each_field(tmp_path: Path) -> None:
    out = _two_fields(tmp_path)
    data = json.loads((out / "manifest.json").read_text())
    # Token ids below 251 are stored as uint8 whatever the file's dtype (uint16).
    assert data["format_version"] == 2 and data["sample"]["row_bytes"] == 16 * 1 + 16 * 4
    assert data["sample"]["fields"] == [
        {"name": "tokens", "dtype": "uint8", "shape": [16]},
        {"name": "loss_mask", "dtype": "float32", "shape": [16]},
    ]
    with Dataset.open(str(out)) as ds:
        assert ds.manifest.fields == (Field("tokens", "uint8", (16,)),
                                      Field("loss_mask", "float32", (16,)))  # fmt: skip
        assert ds.version_id == data["version_id"]
        records, bad = ds.read_records(np.array([3, 0]))
        assert not bad and np.array_equal(records["tokens"][0], np.arange(48, 64) % 251)


@pytest.mark.parametrize(
    "edit,field",
    [
        (lambda d: d["sample"]["fields"][1].update(dtype="uint64"), "sample.fields[1].dtype"),
        (lambda d: d["sample"]["fields"][1].update(name="weight"), "sample.fields[1].name"),
        (lambda d: d["sample"]["fields"][1].update(name="tokens"), "field names must be unique"),
        (lambda d: d["sample"]["fields"][1].update(shape=[0]), "sample.fields[1].shape"),
        (lambda d: d["sample"]["fields"][1].update(shape=[8]), r"parts\[0\]\.bytes"),
        (lambda d: d["sample"]["fields"].reverse(), "sample.fields[0].name"),
        (lambda d: d["sample"].update(row_bytes=7), "sample.row_bytes"),
        (lambda d: d["build"].update(vocab_size=9), "version_id: does not match"),
    ],
)
def test_a_bad_fields_manifest_is_an_error_naming_the_field(
    tmp_path: Path, edit, field: str
) -> None:
    out = _two_fields(tmp_path)
    _edit(out, edit)
    with pytest.raises(DataError, match=r"manifest\.json") as info:
        Dataset.open(str(out))
    assert field.replace("\\", "") in str(info.value), str(info.value)


def test_fields_stream_from_a_remote_url_like_a_local_one(tmp_path: Path) -> None:
    out = _two_fields(tmp_path)
    url = copy_to_memory(out, "memory://fields-ds")
    with Dataset.open(str(out)) as local, Dataset.open(url, cache_dir=str(tmp_path / "c")) as mem:
        a = SlotLoader(local, seed=5, global_batch=8, slots=2)
        b = SlotLoader(mem, seed=5, global_batch=8, slots=2)
        for t in range(6):
            x, y = a.batch(t, 1), b.batch(t, 1)
            assert np.array_equal(x.tokens, y.tokens)
            assert np.array_equal(x.fields["loss_mask"], y.fields["loss_mask"])


def test_a_corrupt_part_of_a_fields_dataset_serves_zeros_with_weight_nan(tmp_path: Path) -> None:
    out = _two_fields(tmp_path)
    part = out / "shard-00001.bin"
    data = bytearray(part.read_bytes())
    data[0] ^= 0xFF
    part.write_bytes(bytes(data))
    with Dataset.open(str(out)) as ds, SlotLoader(ds, seed=1, global_batch=24, slots=1) as ld:
        b = ld.batch(0, 0)
        hit = b.parts == 1
        assert b.bad_parts == (1,) and hit.any() and np.isnan(b.weight[hit]).all()
        assert (b.tokens[hit] == 0).all() and (b.fields["loss_mask"][hit] == 0).all()
        assert np.isfinite(b.weight[~hit]).all()


def test_a_batch_reaches_loss_fn_as_named_tensors_beside_weight(tmp_path: Path) -> None:
    out = _two_fields(tmp_path)
    with Dataset.open(str(out)) as ds, SlotLoader(ds, seed=1, global_batch=8, slots=2) as ld:
        t = to_tensors(ld.batch(2, 1))
    assert set(t) == {"tokens", "weight", "loss_mask"}
    assert t["tokens"].dtype == torch.int64 and t["loss_mask"].dtype == torch.float32
    assert t["loss_mask"].shape == (4, 16)


def test_a_field_spec_names_both_values_when_it_does_not_fit() -> None:
    mask = Field("loss_mask", "uint8", (16,))
    assert FieldSpec("integer", (None,)).mismatch(mask) is None
    assert FieldSpec("float").mismatch(mask) == (
        "has dtype uint8 in the dataset, the task needs float"
    )
    assert FieldSpec(shape=(15,)).mismatch(mask) == (
        "has shape [16] in the dataset, the task needs [15]"
    )
    with pytest.raises(ValueError, match=r"FieldSpec\.dtype"):
        FieldSpec("bfloat16")
