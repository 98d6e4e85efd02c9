from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from perdure.checkpoint import (
    CorruptCheckpointError,
    FormatVersionError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    verify_checkpoint,
)
from perdure.checkpoint.reference_reader import Checkpoint, ReaderError
from tests.checkpoint_support import make_state, rewrite_manifest


def _saved(root: Path, step: int = 3) -> Path:
    return save_checkpoint(root, make_state(step=step))


def _part(path: Path) -> Path:
    (part,) = path.glob("*.safetensors")
    return part


def _flip(file: Path, offset_from_end: int = 10) -> None:
    data = bytearray(file.read_bytes())
    data[-offset_from_end] ^= 0x01
    file.write_bytes(bytes(data))


def _all_readers_fail(path: Path, match: str) -> None:
    for check in (load_checkpoint, verify_checkpoint):
        with pytest.raises(CorruptCheckpointError, match=match):
            check(path)
    with pytest.raises(ReaderError, match=match):
        Checkpoint(path)


def test_flipped_byte_names_the_corrupt_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    _flip(_part(path))
    _all_readers_fail(path, f"{_part(path).name}: checksum mismatch")


def test_flipped_byte_in_context_names_the_context_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    _flip(path / "context.json", 30)
    _all_readers_fail(path, "context.json: checksum mismatch")


def test_load_without_verify_skips_checksums_but_not_structure(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    _flip(_part(path))
    load_checkpoint(path, verify=False)
    (path / "context.json").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"context\.json: missing"):
        load_checkpoint(path, verify=False)


def test_truncated_file_names_the_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    part = _part(path)
    part.write_bytes(part.read_bytes()[:-7])
    _all_readers_fail(path, f"{part.name}: size is")


def test_deleted_file_names_the_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    part = _part(path)
    part.unlink()
    _all_readers_fail(path, f"{part.name}: missing")


def test_malformed_manifest_json_names_the_manifest(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    (path / "manifest.json").write_text('{"format": "perdure-checkpoint", "version": ')
    _all_readers_fail(path, "manifest.json: not valid JSON")


def test_unknown_major_version_is_a_clear_error(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    m = json.loads((path / "manifest.json").read_text())
    m["version"] = {"major": 2, "minor": 0}
    (path / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(FormatVersionError, match=r"manifest.json: format version 2.0 is not"):
        load_checkpoint(path)
    with pytest.raises(ReaderError, match=r"version 2\.0 is not supported"):
        Checkpoint(path)


def test_unknown_optional_fields_and_newer_minor_are_ignored(tmp_path: Path) -> None:
    path = _saved(tmp_path)

    def newer(m: dict) -> None:  # type: ignore[type-arg]
        m["version"]["minor"] = 7
        m["future_field"] = {"anything": [1, 2]}

    rewrite_manifest(path, newer)
    assert load_checkpoint(path).step == 3
    assert Checkpoint(path).step == 3


def _rewrite_header(part: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Edit a part file's safetensors header, and the manifest's size for it."""
    data = part.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    edit(header)
    raw = json.dumps(header, separators=(",", ":")).encode()
    new = struct.pack("<Q", len(raw)) + raw + data[8 + n :]
    part.write_bytes(new)
    rewrite_manifest(part.parent, lambda m: m["files"][part.name].__setitem__("bytes", len(new)))


def test_header_offsets_past_the_file_name_the_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    part = _part(path)

    _rewrite_header(
        part,
        lambda h: h.__setitem__(
            "model/w32",
            {**h["model/w32"], "data_offsets": [h["model/w32"]["data_offsets"][0], 10**9]},
        ),
    )
    with pytest.raises(CorruptCheckpointError, match=f"{part.name}: .*offsets"):
        load_checkpoint(path, verify=False)
    with pytest.raises(ReaderError, match=f"{part.name}: .*offsets"):
        Checkpoint(path, verify=False).tensor("model/w32")


def test_header_length_past_the_file_names_the_file(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    part = _part(path)
    data = part.read_bytes()
    part.write_bytes(struct.pack("<Q", 10**6) + data[8:])
    with pytest.raises(CorruptCheckpointError, match=f"{part.name}: header length"):
        load_checkpoint(path, verify=False)
    with pytest.raises(ReaderError, match=f"{part.name}: header length"):
        Checkpoint(path, verify=False).tensor("model/w32")


def test_latest_skips_a_corrupt_checkpoint_with_a_warning_naming_the_file(tmp_path: Path) -> None:
    good = _saved(tmp_path, step=1)
    bad = _saved(tmp_path, step=2)
    _flip(_part(bad))
    with pytest.warns(UserWarning, match=f"{_part(bad).name}: checksum mismatch"):
        assert latest_checkpoint(tmp_path) == good


def test_latest_ignores_uncommitted_directories(tmp_path: Path) -> None:
    good = _saved(tmp_path, step=1)
    newer = _saved(tmp_path, step=2)
    (newer / "manifest.json").unlink()
    (tmp_path / "step-000000009.tmp-abc123").mkdir()
    assert latest_checkpoint(tmp_path) == good
    assert latest_checkpoint(tmp_path / "nothing-here") is None
