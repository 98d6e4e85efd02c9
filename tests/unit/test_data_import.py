"""perdure data import: .npy and raw token files as a versioned dataset, bitwise, with the
tail rule, dtypes and vocabulary recorded; bad inputs are clear errors that leave nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from perdure.cli import main
from perdure.data import DataError, Dataset, SlotLoader
from perdure.data.importer import import_arrays

SEQ = 31
ROW = SEQ + 1


def _stream(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, n, dtype=np.int64)


def _rows(out: Path) -> np.ndarray:
    with Dataset.open(str(out)) as ds:
        return ds.read(np.arange(ds.num_samples))


@pytest.mark.parametrize("dtype,vocab", [("uint16", 50257), ("uint32", 100277)])
def test_a_raw_token_file_reads_back_bitwise_cut_into_samples_with_the_tail_dropped(
    tmp_path: Path, dtype: str, vocab: int
) -> None:
    tokens = _stream(10 * ROW + 7, vocab)
    tokens[3] = vocab - 1  # the largest id occurs: the vocabulary is exactly vocab
    (tmp_path / "train.bin").write_bytes(tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    m = import_arrays({"tokens": [str(tmp_path / "train.bin")]}, str(tmp_path / "ds"),
                      seq_len=SEQ, dtype=dtype, part_mb=3 * ROW * 4 / (1 << 20))  # fmt: skip
    rows = _rows(tmp_path / "ds")
    assert rows.shape == (10, ROW) and np.array_equal(rows.reshape(-1), tokens[: 10 * ROW])
    assert m.sources["dropped_tail"] == {"tokens": 7} and m.sources["vocab_size_from"] == "max_id"
    assert m.build["vocab_size"] == vocab and m.dtype == ("uint16" if vocab <= 65536 else "uint32")
    assert m.sources["inputs"] == [
        {"field": "tokens", "file": "train.bin", "dtype": dtype, "shape": [10 * ROW + 7]}
    ]
    assert m.format_version == 1 and len(m.parts) > 1


def test_npy_files_import_as_streams_or_as_samples_and_agree(tmp_path: Path) -> None:
    tokens = _stream(6 * ROW, 1000)
    np.save(tmp_path / "a.npy", tokens[: 4 * ROW].astype(np.int32))
    np.save(tmp_path / "b.npy", tokens[4 * ROW :].astype(np.int64))
    np.save(tmp_path / "rows.npy", tokens.reshape(6, ROW).astype(np.int32))
    with pytest.raises(DataError, match="must agree in dtype"):
        import_arrays({"tokens": [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]},
                      str(tmp_path / "x"), seq_len=SEQ)  # fmt: skip
    np.save(tmp_path / "b.npy", tokens[4 * ROW :].astype(np.int32))
    s = import_arrays({"tokens": [str(tmp_path / "a.npy"), str(tmp_path / "b.npy")]},
                      str(tmp_path / "s"), seq_len=SEQ, vocab_size=1000)  # fmt: skip
    r = import_arrays({"tokens": [str(tmp_path / "rows.npy")]}, str(tmp_path / "r"),
                      vocab_size=1000)  # fmt: skip
    assert np.array_equal(_rows(tmp_path / "s").reshape(-1), tokens)
    assert s.version_id == r.version_id and s.seq_len == r.seq_len == SEQ
    assert s.dtype == "uint16" and "dropped_tail" not in r.sources


def test_the_tokenizer_name_and_the_vocabulary_enter_the_version_id(tmp_path: Path) -> None:
    (tmp_path / "t.bin").write_bytes(_stream(4 * ROW, 500).astype("<u2").tobytes())
    ids = {
        import_arrays({"tokens": [str(tmp_path / "t.bin")]}, str(tmp_path / f"o{i}"),
                      seq_len=SEQ, dtype="uint16", **kw).version_id  # type: ignore[arg-type]
        for i, kw in enumerate([{}, {"vocab_size": 50257}, {"tokenizer": "gpt2"}])
    }  # fmt: skip
    assert len(ids) == 3


def test_a_multi_field_import_serves_each_field_bitwise_beside_the_tokens(tmp_path: Path) -> None:
    n = 40 * ROW
    tokens = _stream(n, 300)
    mask = (np.arange(n) % 5 != 0).astype(np.uint8)
    (tmp_path / "t.bin").write_bytes(tokens.astype("<u2").tobytes())
    (tmp_path / "m.bin").write_bytes(mask.tobytes())
    np.save(tmp_path / "labels.npy", tokens.reshape(40, ROW)[:, ::-1].astype(np.int32))
    np.save(tmp_path / "score.npy", np.linspace(0, 1, 40, dtype=np.float32))
    m = import_arrays(
        {"tokens": [str(tmp_path / "t.bin")], "loss_mask": [str(tmp_path / "m.bin")],
         "labels": [str(tmp_path / "labels.npy")], "score": [str(tmp_path / "score.npy")]},
        str(tmp_path / "ds"), seq_len=SEQ, dtype="uint16", dtypes={"loss_mask": "uint8"},
        part_mb=7 * 100 / (1 << 20),
    )  # fmt: skip
    assert m.format_version == 2 and [f.name for f in m.fields] == [
        "tokens", "loss_mask", "labels", "score"]  # fmt: skip
    assert [(f.dtype, f.shape) for f in m.fields] == [
        ("uint16", (ROW,)), ("uint8", (ROW,)), ("int32", (ROW,)), ("float32", ())]  # fmt: skip
    with (
        Dataset.open(str(tmp_path / "ds")) as ds,
        SlotLoader(ds, seed=3, global_batch=8, slots=4, prefetch_steps=0) as loader,
    ):
        for step in range(12):
            for slot in range(4):
                b = loader.batch(step, slot)
                i = b.sample_ids
                assert np.array_equal(b.tokens, tokens.reshape(40, ROW)[i])
                assert np.array_equal(b.fields["loss_mask"], mask.reshape(40, ROW)[i])
                assert np.array_equal(b.fields["labels"], tokens.reshape(40, ROW)[i, ::-1])
                assert np.array_equal(b.fields["score"], np.linspace(0, 1, 40, dtype=np.float32)[i])
                assert b.fields["loss_mask"].dtype == np.int64
                assert b.fields["score"].dtype == np.float32


@pytest.mark.parametrize(
    "write,kw,message",
    [
        (
            lambda d: (d / "t.bin").write_bytes(b"\x01\x00\x02"),
            {"dtype": "uint16"},
            r"t\.bin: size 3 bytes is not a multiple of 2 bytes",
        ),
        (
            lambda d: (d / "t.bin").write_bytes(b"\x01\x00" * 64),
            {"dtype": "float8"},
            r"--dtype: must be one of",
        ),
        (
            lambda d: (d / "t.bin").write_bytes(b"\x01\x00" * 64),
            {},
            r"t\.bin: a raw file needs its dtype \(--dtype",
        ),
        (
            lambda d: (d / "t.bin").write_bytes(b"\x01\x00" * 64),
            {"dtype": "float32"},
            r"t\.bin: token ids must be integers \(got dtype float32\)",
        ),
        (
            lambda d: (d / "t.bin").write_bytes(np.full(64, -1, "<i4").tobytes()),
            {"dtype": "int32"},
            r"token ids must be >= 0 \(got -1",
        ),
        (
            lambda d: (d / "t.bin").write_bytes(np.full(64, 900, "<u2").tobytes()),
            {"dtype": "uint16", "vocab_size": 512},
            r"must be below --vocab-size 512 \(got 900",
        ),
        (
            lambda d: (d / "t.bin").write_bytes(np.ones(20, "<u2").tobytes()),
            {"dtype": "uint16"},
            "fewer than one sample of 32 tokens",
        ),
        (lambda d: (d / "t.bin").write_text("not an npy"), {}, r"a raw file needs its dtype"),
    ],
)
def test_bad_input_is_a_clear_error_naming_the_file_and_leaves_nothing(
    tmp_path: Path, write, kw: dict, message: str
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write(src)
    with pytest.raises(DataError, match=message):
        import_arrays({"tokens": [str(src / "t.bin")]}, str(tmp_path / "ds"), seq_len=SEQ, **kw)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_fields_that_do_not_line_up_are_refused_naming_both(tmp_path: Path) -> None:
    (tmp_path / "t.bin").write_bytes(np.ones(4 * ROW, "<u2").tobytes())
    (tmp_path / "m.bin").write_bytes(np.ones(4 * ROW - 1, "u1").tobytes())
    np.save(tmp_path / "bad.npy", np.ones((3, 2), np.float32))
    (tmp_path / "x.npy").write_bytes(b"\x93NUMPY garbage")
    t = [str(tmp_path / "t.bin")]
    cases = [
        ({"loss_mask": [str(tmp_path / "m.bin")]}, {"loss_mask": "uint8"},
         "'loss_mask' has 127 values in its stream, 'tokens' 128"),
        ({"extra": [str(tmp_path / "bad.npy")]}, {}, "'extra' has 3 samples, 'tokens' 4"),
        ({"weight": [str(tmp_path / "bad.npy")]}, {}, "'weight' is reserved"),
        ({"Bad-Name": [str(tmp_path / "bad.npy")]}, {}, "field name must match"),
        ({"x": [str(tmp_path / "x.npy")]}, {}, r"x\.npy: not a readable \.npy file"),
    ]  # fmt: skip
    for extra, dtypes, message in cases:
        with pytest.raises(DataError, match=message):
            import_arrays({"tokens": t, **extra}, str(tmp_path / "ds"), seq_len=SEQ,
                          dtype="uint16", dtypes=dtypes)  # fmt: skip
        assert not (tmp_path / "ds").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_the_cli_imports_a_nanogpt_bin_with_a_mask_field_and_inspect_lists_the_fields(
    tmp_path: Path,
) -> None:
    (tmp_path / "train.bin").write_bytes(_stream(5 * ROW + 3, 50257).astype("<u2").tobytes())
    (tmp_path / "mask.bin").write_bytes(np.ones(5 * ROW + 3, "u1").tobytes())
    out = tmp_path / "ds"
    r = CliRunner().invoke(main, [
        "data", "import", str(tmp_path / "train.bin"), "--out", str(out), "--seq-len", str(SEQ),
        "--dtype", "uint16", "--field", f"loss_mask={tmp_path / 'mask.bin'}:uint8",
        "--vocab-size", "50304", "--tokenizer-name", "gpt2"])  # fmt: skip
    assert r.exit_code == 0, r.output
    assert "5 samples (tokens: uint16 [32], loss_mask: uint8 [32])" in r.output
    assert "dropped the last 3 values of tokens" in r.output
    assert "vocabulary: 50304 (from --vocab-size)" in r.output
    info = CliRunner().invoke(main, ["data", "inspect", str(out), "--json"])
    fields = json.loads(info.output)["fields"]
    assert fields == "tokens: uint16 [32]; loss_mask: uint8 [32]"
    ok = CliRunner().invoke(main, ["data", "verify", str(out)])
    assert ok.exit_code == 0, ok.output
    bad = CliRunner().invoke(main, ["data", "import", str(tmp_path / "train.bin"), "--out",
                                    str(tmp_path / "x"), "--seq-len", "7"])  # fmt: skip
    assert bad.exit_code == 1 and "a raw file needs its dtype" in bad.output
    helped = CliRunner().invoke(main, ["data", "import", "--help"])
    assert "--field" in helped.output and "tail" in helped.output
