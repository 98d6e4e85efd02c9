"""``perdure data import --in-place``: the dataset references the token files where they lie
(nothing copied), trains bitwise-equal to a copy import of the same tokens, and a file that
changed since the import is refused with its name."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from perdure.data import DataError, Dataset
from perdure.data.errors import PartError
from perdure.data.importer import import_arrays
from perdure.data.inplace import import_in_place
from tests.formats_support import write_megatron
from tests.runtime_support import STDLIB, run_to_end, small_config

SEQ = 64


def _tokens() -> np.ndarray:
    text = b"".join(f.read_bytes() for f in sorted((STDLIB / "json").glob("*.py")))
    return np.frombuffer(text, np.uint8).astype("<u2")


def _all(ds: Path) -> np.ndarray:
    with Dataset.open(str(ds)) as d:
        return d.read(np.arange(d.num_samples))


def test_an_in_place_import_writes_only_its_manifest_and_reads_the_same_samples(
    tmp_path: Path,
) -> None:
    tokens = _tokens()
    tokens.tofile(tmp_path / "train.bin")
    np.save(tmp_path / "train.npy", tokens)
    copy = import_arrays({"tokens": [str(tmp_path / "train.bin")]}, str(tmp_path / "copy"),
                         seq_len=SEQ, dtype="uint16", vocab_size=300)  # fmt: skip
    for src in ("train.bin", "train.npy"):
        out = tmp_path / f"in-place-{src}"
        m = import_in_place([str(tmp_path / src)], str(out), seq_len=SEQ, dtype="uint16",
                            vocab_size=300)  # fmt: skip
        assert [p.name for p in out.iterdir()] == ["manifest.json"]
        assert m.format_version == 3 and m.parts[0].source is not None
        assert np.array_equal(_all(out), _all(tmp_path / "copy"))
    assert copy.num_samples == m.num_samples


def test_a_changed_file_is_refused_with_its_name(tmp_path: Path) -> None:
    tokens = _tokens()
    tokens.tofile(tmp_path / "t.bin")
    import_in_place([str(tmp_path / "t.bin")], str(tmp_path / "o"), seq_len=SEQ, dtype="uint16")
    changed = tokens.copy()
    changed[5] += 1
    changed.tofile(tmp_path / "t.bin")
    ds = Dataset.open(str(tmp_path / "o"))
    with pytest.raises(PartError, match=r"t.bin\): changed since"):
        ds.read(np.arange(2))
    ds.close()
    tokens[:-1].tofile(tmp_path / "t.bin")
    with pytest.raises(DataError, match=r"t.bin: changed since it was imported in place \(size"):
        Dataset.open(str(tmp_path / "o"))


def test_int64_and_negative_ids_cannot_be_served_in_place(tmp_path: Path) -> None:
    np.save(tmp_path / "w.npy", np.arange(100, dtype=np.int64))
    with pytest.raises(DataError, match="int64 file needs a copy import"):
        import_in_place([str(tmp_path / "w.npy")], str(tmp_path / "o"), seq_len=9)
    np.save(tmp_path / "n.npy", np.arange(-1, 99, dtype=np.int32))
    with pytest.raises(DataError, match="must be >= 0"):
        import_in_place([str(tmp_path / "n.npy")], str(tmp_path / "o"), seq_len=9)
    assert not (tmp_path / "o").exists()


def test_a_run_on_an_in_place_megatron_import_trains_bitwise_equal_to_a_copy(
    tmp_path: Path,
) -> None:
    tokens = _tokens().astype(np.uint8)
    docs = np.array_split(tokens, 9)
    write_megatron(tmp_path / "meg", list(docs), np.uint8)
    np.save(tmp_path / "tokens.npy", tokens)
    import_arrays({"tokens": [str(tmp_path / "tokens.npy")]}, str(tmp_path / "npy"),
                  seq_len=SEQ, vocab_size=256, tokenizer="bytes", part_mb=0.05)  # fmt: skip
    cmd = [sys.executable, "-m", "perdure", "data", "import", "--format", "megatron",
           "--in-place", str(tmp_path / "meg"), "--out", str(tmp_path / "mp"), "--seq-len",
           str(SEQ), "--vocab-size", "256", "--tokenizer-name", "bytes"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "referencing 1 files in place" in res.stdout
    hashes = {}
    for kind in ("npy", "mp"):
        out = run_to_end(small_config(tmp_path / kind, workers=1, steps=6), tmp_path / f"r{kind}")
        hashes[kind] = out["final_hash"]
    assert hashes["mp"] == hashes["npy"]
