"""The formats large runs arrive in: a Megatron indexed dataset and MDS parts written by
their own libraries import to the same samples as the same tokens imported as ``.npy``, and
a run on each trains to bitwise-equal final weights."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from perdure.data import DataError, Dataset
from perdure.data.formats import import_mds, import_megatron, read_megatron
from perdure.data.importer import import_arrays
from tests.formats_support import write_mds, write_megatron
from tests.runtime_support import STDLIB, run_to_end, small_config

SEQ = 64


def _docs() -> list[np.ndarray]:
    """The stdlib's json package, one document a file, as byte ids (below 256)."""
    return [np.frombuffer(f.read_bytes(), np.uint8).copy()
            for f in sorted((STDLIB / "json").glob("*.py"))]  # fmt: skip


def _samples(ds: Path) -> np.ndarray:
    with Dataset.open(str(ds)) as d:
        return d.read(np.arange(d.num_samples))


@pytest.fixture(scope="module")
def imported(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("formats")
    docs = _docs()
    np.save(root / "tokens.npy", np.concatenate(docs).astype(np.int64))
    kw = {"seq_len": SEQ, "vocab_size": 256, "tokenizer": "bytes", "part_mb": 0.05}
    out = {"npy": root / "npy", "megatron": root / "megatron", "mds": root / "mds"}
    import_arrays({"tokens": [str(root / "tokens.npy")]}, str(out["npy"]), **kw)
    write_megatron(root / "meg", docs, np.int32)
    import_megatron([str(root / "meg")], str(out["megatron"]), **kw)
    write_mds(root / "mdsdir", [d.astype(np.uint16) for d in docs], "ndarray:uint16",
              size_limit=1 << 14)  # fmt: skip
    import_mds([str(root / "mdsdir")], str(out["mds"]), **kw)
    return out


def test_megatron_and_mds_import_to_the_samples_of_the_same_tokens_as_npy(
    imported: dict[str, Path],
) -> None:
    ref = _samples(imported["npy"])
    for kind in ("megatron", "mds"):
        assert np.array_equal(_samples(imported[kind]), ref), kind
    m = Dataset.open(str(imported["megatron"])).manifest
    assert m.sources["documents"] == len(_docs()) and m.sources["format"] == "megatron"


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.uint16, np.int32, np.int64])
def test_every_integer_megatron_dtype_imports(tmp_path: Path, dtype: type) -> None:
    docs = [np.arange(i, i + 50) % 100 for i in range(7)]
    write_megatron(tmp_path / "p", docs, dtype)
    idx = read_megatron(str(tmp_path / "p"))
    assert idx.dtype == np.dtype(dtype).name and idx.doc_starts.tolist() == [
        50 * i for i in range(7)
    ]
    m = import_megatron([str(tmp_path / "p")], str(tmp_path / "o"), seq_len=9)
    assert np.array_equal(_samples(tmp_path / "o").reshape(-1), np.concatenate(docs)[:350])
    assert m.build["vocab_size"] == 56  # the largest id (6 + 49) + 1


def test_float_megatron_tokens_and_a_broken_index_are_refused(tmp_path: Path) -> None:
    write_megatron(tmp_path / "f", [np.arange(20)], np.float32)
    with pytest.raises(DataError, match=r"f.idx: the tokens are float32"):
        import_megatron([str(tmp_path / "f")], str(tmp_path / "o"), seq_len=3)
    write_megatron(tmp_path / "t", [np.arange(20)], np.uint16)
    (tmp_path / "t.bin").write_bytes((tmp_path / "t.bin").read_bytes()[:-2])
    with pytest.raises(DataError, match=r"t.bin: 38 bytes, but .*t.idx says 40"):
        import_megatron([str(tmp_path / "t")], str(tmp_path / "o"), seq_len=3)


@pytest.mark.parametrize("encoding", ["ndarray", "ndarray:int32", "ndarray:uint16:50"])
def test_mds_token_columns_of_every_ndarray_encoding_import(tmp_path: Path, encoding: str) -> None:
    kind = np.uint16 if encoding.endswith(":50") else np.int32
    docs = [(np.arange(50) * (i + 1) % 300).astype(kind) for i in range(6)]
    write_mds(tmp_path / "m", docs, encoding, compression="zstd")
    import_mds([str(tmp_path / "m")], str(tmp_path / "o"), seq_len=9)
    assert np.array_equal(_samples(tmp_path / "o").reshape(-1), np.concatenate(docs))
    with pytest.raises(DataError, match="no column 'ids'"):
        import_mds([str(tmp_path / "m")], str(tmp_path / "x"), column="ids", seq_len=9)


def test_runs_on_megatron_and_mds_imports_train_bitwise_equal_to_npy(
    imported: dict[str, Path], tmp_path: Path
) -> None:
    hashes = {}
    for kind, ds in imported.items():
        res = run_to_end(small_config(ds, workers=1, steps=6), tmp_path / kind)
        assert res["steps"] == 6
        hashes[kind] = res["final_hash"]
    assert hashes["megatron"] == hashes["npy"] == hashes["mds"]


def test_the_cli_imports_a_megatron_prefix(tmp_path: Path) -> None:
    write_megatron(tmp_path / "p", [np.arange(300) % 256], np.uint16)
    cmd = [sys.executable, "-m", "perdure", "data", "import", "--format", "megatron",
           str(tmp_path / "p"), "--out", str(tmp_path / "o"), "--seq-len", "15"]  # fmt: skip
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "from 1 megatron sources (1 documents)" in res.stdout


def test_document_boundaries_are_kept_and_give_doc_ids_and_position_ids(tmp_path: Path) -> None:
    from perdure.data import SlotLoader

    docs = [np.full(n, i + 1) for i, n in enumerate([5, 12, 3, 20])]  # 40 tokens, seq_len 9
    write_megatron(tmp_path / "p", docs, np.uint16)
    import_megatron([str(tmp_path / "p")], str(tmp_path / "o"), seq_len=9)
    ds = Dataset.open(str(tmp_path / "o"))
    assert ds.documents().tolist() == [0, 5, 17, 20]
    f = ds.doc_fields(np.array([0, 1, 3]))
    tokens = ds.read(np.array([0, 1, 3]))
    for r in range(3):  # a boundary exactly where the token value changes
        change = np.concatenate([[0], np.cumsum(np.diff(tokens[r].astype(int)) != 0)])
        assert f["doc_ids"][r].tolist() == change.tolist()
    assert f["position_ids"][0].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    assert f["position_ids"][1].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2]  # from its start
    with SlotLoader(ds, seed=0, global_batch=2, slots=1, document_fields=True) as ld:
        b = ld.batch(0, 0)
    assert set(b.fields) >= {"doc_ids", "position_ids"} and b.fields["doc_ids"].shape == (2, 10)
    ds.close()
    npy = tmp_path / "t.npy"
    np.save(npy, np.concatenate(docs))
    import_arrays({"tokens": [str(npy)]}, str(tmp_path / "plain"), seq_len=9)
    with (
        Dataset.open(str(tmp_path / "plain")) as plain,
        pytest.raises(DataError, match="no document"),
    ):
        plain.documents()


def test_a_run_with_document_fields_hands_them_to_the_task_and_they_are_math(
    imported: dict[str, Path], tmp_path: Path
) -> None:
    """``data.document_fields``: the task's loss reads ``doc_ids`` and ``position_ids``
    (tests/document_task.py); one worker and three give the same bits, a plain ``.npy``
    import (no boundaries) is refused naming the dataset, and the field is in the hash."""
    task = {"entry": "tests.document_task:make_task", "options": {}}
    on = {"document_fields": True}
    one = run_to_end(
        small_config(imported["megatron"], workers=1, steps=6, task=task, data=on), tmp_path / "1"
    )
    three = run_to_end(
        small_config(imported["megatron"], workers=3, steps=6, task=task, data=on), tmp_path / "3"
    )
    assert one["final_hash"] == three["final_hash"] is not None
    from perdure.run_config import config_hash

    plain = small_config(imported["megatron"], steps=6, task=task)
    assert config_hash(plain) != config_hash(
        small_config(imported["megatron"], steps=6, task=task, data=on)
    )
    with pytest.raises(Exception, match=r"data.document_fields: .*npy holds none"):
        run_to_end(
            small_config(imported["npy"], workers=1, steps=2, task=task, data=on), tmp_path / "n"
        )
