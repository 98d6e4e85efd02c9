from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from perdure.data import DataError, Dataset, build_dataset
from tests.unit.test_data_support import PART_MB, ROW, SEQ_LEN, make_dataset, write_corpus


def _part_bytes(out: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(out.iterdir())}


def test_same_sources_give_same_version_id_and_byte_identical_files(tmp_path: Path) -> None:
    a = write_corpus(tmp_path / "here")
    b = write_corpus(tmp_path / "elsewhere" / "mounted")
    ma = build_dataset([str(a)], str(tmp_path / "A"), seq_len=SEQ_LEN, part_mb=PART_MB)
    mb = build_dataset([str(b)], str(tmp_path / "B"), seq_len=SEQ_LEN, part_mb=PART_MB)
    assert ma.version_id == mb.version_id
    assert ma.version_id.startswith("sha256:")
    assert _part_bytes(tmp_path / "A") == _part_bytes(tmp_path / "B")


def test_one_byte_change_gives_a_different_version_id(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")
    m1 = build_dataset([str(src)], str(tmp_path / "one"), seq_len=SEQ_LEN, part_mb=PART_MB)
    f = src / "d1" / "f04.txt"
    data = bytearray(f.read_bytes())
    data[100] = ord("Z") if data[100] != ord("Z") else ord("Y")
    f.write_bytes(bytes(data))
    m2 = build_dataset([str(src)], str(tmp_path / "two"), seq_len=SEQ_LEN, part_mb=PART_MB)
    assert m1.version_id != m2.version_id


def test_build_parameters_enter_the_version_id(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")
    ids = {
        build_dataset([str(src)], str(tmp_path / f"o{i}"), **kw).version_id  # type: ignore[arg-type]
        for i, kw in enumerate([{"seq_len": 15}, {"seq_len": 16}, {"seq_len": 15, "separator": 10}])
    }
    assert len(ids) == 3


def test_samples_are_the_token_stream_cut_into_rows_with_a_separator_per_file(
    tmp_path: Path,
) -> None:
    src = write_corpus(tmp_path / "src", files=3)
    out = tmp_path / "ds"
    m = build_dataset([str(src)], str(out), seq_len=SEQ_LEN, part_mb=PART_MB)
    files = sorted(src.rglob("*.txt"), key=lambda p: p.relative_to(src).as_posix())
    stream = b"".join(f.read_bytes() + b"\x00" for f in files)
    n = len(stream) // ROW
    assert m.num_samples == n
    expected = np.frombuffer(stream[: n * ROW], dtype=np.uint8).reshape(n, ROW)
    with Dataset.open(str(out)) as ds:
        assert np.array_equal(ds.read(np.arange(n)), expected)
    assert m.dtype == "uint8" and m.sample_shape == (ROW,)
    assert all(s.samples == 16 for s in m.parts[:-1])


def test_glob_and_include_select_files(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")
    (src / "skip.bin").write_bytes(b"\x01" * 1000)
    by_dir = build_dataset([str(src)], str(tmp_path / "a"), seq_len=SEQ_LEN, include="*.txt")
    by_glob = build_dataset([f"{src}/**/*.txt"], str(tmp_path / "b"), seq_len=SEQ_LEN)
    assert by_dir.sources["files"] == 8
    assert by_dir.version_id == by_glob.version_id


def test_max_mb_caps_the_source_bytes_read(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")
    m = build_dataset([str(src)], str(tmp_path / "o"), seq_len=SEQ_LEN, max_mb=1000 / (1 << 20))
    assert m.sources["bytes"] == 1000
    assert m.sources["files"] == 2


def test_existing_output_is_an_error_unless_overwrite(tmp_path: Path) -> None:
    _, m = make_dataset(tmp_path)
    with pytest.raises(DataError, match="already exists"):
        make_dataset(tmp_path)
    _, again = make_dataset(tmp_path, overwrite=True)
    assert again.version_id == m.version_id
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_failed_build_leaves_nothing_behind(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")

    def broken(data: bytes) -> np.ndarray:
        raise RuntimeError("tokenizer crashed")

    with pytest.raises(RuntimeError):
        build_dataset([str(src)], str(tmp_path / "o"), tokenizer=broken, vocab_size=300)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_custom_tokenizer_needs_a_vocab_size_and_its_ids_are_checked(tmp_path: Path) -> None:
    src = write_corpus(tmp_path / "src")

    def words(data: bytes) -> np.ndarray:
        return np.array([len(w) + 256 for w in data.split()], dtype=np.int64)

    with pytest.raises(DataError, match="vocab_size"):
        build_dataset([str(src)], str(tmp_path / "a"), tokenizer=words)
    with pytest.raises(DataError, match=r"f00\.txt: token ids must be in \[0, 257\)"):
        build_dataset([str(src)], str(tmp_path / "b"), tokenizer=words, vocab_size=257, seq_len=3)
    m = build_dataset([str(src)], str(tmp_path / "c"), tokenizer=words, vocab_size=300, seq_len=3)
    assert m.dtype == "uint16"
    assert m.build["tokenizer"].endswith("words")
    with Dataset.open(str(tmp_path / "c")) as ds:
        assert int(ds.read(np.arange(ds.num_samples)).max()) < 300


def test_too_little_data_and_a_missing_source_are_errors_naming_them(tmp_path: Path) -> None:
    tiny = tmp_path / "tiny.txt"
    tiny.write_text("hi")
    with pytest.raises(DataError, match="fewer than one sample"):
        build_dataset([str(tiny)], str(tmp_path / "o"))
    with pytest.raises(DataError, match=r"nope\.txt"):
        build_dataset([str(tmp_path / "nope.txt")], str(tmp_path / "o"))
    with pytest.raises(DataError, match="seq_len must be >= 1"):
        build_dataset([str(tiny)], str(tmp_path / "o"), seq_len=0)
    assert not (tmp_path / "o").exists()


def test_parts_are_raw_little_endian_arrays_numpy_can_memory_map(tmp_path: Path) -> None:
    out, m = make_dataset(tmp_path)
    s = m.parts[1]
    mm = np.memmap(out / s.file, dtype="<u1", mode="r").reshape(-1, ROW)
    assert mm.shape == (s.samples, ROW)
    assert os.path.getsize(out / s.file) == s.bytes
