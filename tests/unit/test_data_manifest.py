from __future__ import annotations

import json
from pathlib import Path

import pytest

from perdure.data import DataError, Dataset
from tests.unit.test_data_support import make_dataset


def _edit_manifest(out: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = out / "manifest.json"
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


def test_a_malformed_manifest_is_an_error_naming_the_file(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    (out / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match=r"ds/manifest\.json: not valid JSON"):
        Dataset.open(str(out))


def test_a_missing_manifest_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"empty/manifest\.json: missing"):
        Dataset.open(str(tmp_path / "empty"))


def test_a_wrong_dtype_is_an_error_naming_the_file_field_and_value(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    _edit_manifest(out, lambda d: d["sample"].update(dtype="float32"))
    with pytest.raises(DataError) as info:
        Dataset.open(str(out))
    msg = str(info.value)
    assert "manifest.json" in msg and "sample.dtype" in msg and "'float32'" in msg


def test_a_dtype_that_does_not_fit_the_part_sizes_is_an_error(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    _edit_manifest(out, lambda d: d["sample"].update(dtype="uint16"))
    with pytest.raises(DataError, match=r"parts\[0\]\.bytes: must equal samples x row bytes"):
        Dataset.open(str(out))


def test_every_problem_of_a_manifest_is_reported_at_once(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)

    def edit(d: dict) -> None:
        d["format_version"] = 99
        d["seq_len"] = -1
        d["parts"][2]["sha256"] = "xyz"

    _edit_manifest(out, edit)
    with pytest.raises(DataError) as info:
        Dataset.open(str(out))
    msg = str(info.value)
    for field in ("format_version", "seq_len", "parts[2].sha256"):
        assert field in msg


def test_a_manifest_edited_by_hand_no_longer_matches_its_version_id(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    _edit_manifest(out, lambda d: d["build"].update(tokenizer="other"))
    with pytest.raises(DataError, match="version_id: does not match the content"):
        Dataset.open(str(out))


def test_a_missing_part_is_an_error_naming_the_file(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    (out / "shard-00003.bin").unlink()
    with pytest.raises(DataError, match=r"ds/shard-00003\.bin: part file missing"):
        Dataset.open(str(out))


def test_a_truncated_part_is_an_error_naming_the_file(tmp_path: Path) -> None:
    out, _ = make_dataset(tmp_path)
    f = out / "shard-00001.bin"
    f.write_bytes(f.read_bytes()[:-5])
    with pytest.raises(DataError, match=r"shard-00001\.bin: size must be 256 bytes"):
        Dataset.open(str(out))


def test_a_manifest_round_trips_through_json(tmp_path: Path) -> None:
    from perdure.data import parse_manifest

    out, m = make_dataset(tmp_path)
    again = parse_manifest(m.to_json(), "x")
    assert again == m
    assert json.loads((out / "manifest.json").read_text())["version_id"] == m.version_id
