"""perdure data build --tokenizer: any callable text -> ids, named by entry, its identity in
the version id, its output checked; a real tokenizers BPE trained from a local file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from perdure.cli import main
from perdure.data import DataError, Dataset, build_dataset
from tests.tokenizer_support import SPECIAL, WORDS, WordLevel
from tests.unit.test_data_support import write_corpus

ENTRY = "tests.tokenizer_support:words"


def _corpus(tmp: Path) -> Path:
    return write_corpus(tmp / "src", files=6, size=3000)


def _expected_stream(src: Path, tok: WordLevel, sep: int) -> np.ndarray:
    files = sorted(src.rglob("*.txt"), key=lambda f: f.relative_to(src).as_posix())
    out: list[int] = []
    for f in files:
        out += [*tok(f.read_text()), sep]
    return np.array(out, dtype=np.int64)


def _all_tokens(out: Path) -> np.ndarray:
    with Dataset.open(str(out)) as ds:
        return ds.read(np.arange(ds.num_samples)).astype(np.int64).reshape(-1)


def test_an_entry_tokenizer_builds_its_ids_with_its_vocabulary_and_eos(tmp_path: Path) -> None:
    src = _corpus(tmp_path)
    m = build_dataset([str(src)], str(tmp_path / "o"), seq_len=15, tokenizer=ENTRY)
    tok = WordLevel(SPECIAL + WORDS)
    want = _expected_stream(src, tok, sep=1)  # <eos> is id 1
    got = _all_tokens(tmp_path / "o")
    assert np.array_equal(got, want[: got.size]) and want.size - got.size < 16
    assert m.build["tokenizer"] == ENTRY and m.build["vocab_size"] == len(SPECIAL + WORDS)
    assert m.build["separator"] == 1 and m.sources["vocab_size_from"] == "tokenizer"
    assert m.dtype == "uint8"


def test_an_empty_document_gives_no_ids_and_only_its_separator(tmp_path: Path) -> None:
    src = _corpus(tmp_path)
    (src / "d0" / "empty.txt").write_text("")
    m = build_dataset([str(src)], str(tmp_path / "o"), seq_len=15, tokenizer=ENTRY)
    want = _expected_stream(src, WordLevel(SPECIAL + WORDS), sep=1)
    got = _all_tokens(tmp_path / "o")
    assert m.sources["files"] == 7 and np.array_equal(got, want[: got.size])


def test_a_changed_tokenizer_file_is_a_changed_dataset_version(tmp_path: Path) -> None:
    src = _corpus(tmp_path)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join([*SPECIAL, *WORDS, "zeta"]) + "\n")
    kw = {"seq_len": 15, "tokenizer": "tests.tokenizer_support:from_vocab_file"}
    a = build_dataset([str(src)], str(tmp_path / "a"), tokenizer_file=str(vocab), **kw)
    again = build_dataset([str(src)], str(tmp_path / "a2"), tokenizer_file=str(vocab), **kw)
    # A word the corpus never uses: the same ids, vocabulary size and reported identity.
    vocab.write_text("\n".join([*SPECIAL, *WORDS, "omega"]) + "\n")
    b = build_dataset([str(src)], str(tmp_path / "b"), tokenizer_file=str(vocab), **kw)
    assert a.version_id == again.version_id
    assert [s.sha256 for s in a.parts] == [s.sha256 for s in b.parts]
    assert a.build["vocab_size"] == b.build["vocab_size"] == 12
    assert a.version_id != b.version_id
    ident = a.build["tokenizer_identity"]
    assert ident["file"]["name"] == "vocab.txt" and len(ident["file"]["sha256"]) == 64
    assert ident["reported"] == {"kind": "word-level", "words": 12}


def test_without_a_reported_vocabulary_it_is_the_largest_id_plus_one(tmp_path: Path) -> None:
    src = _corpus(tmp_path)
    m = build_dataset([str(src)], str(tmp_path / "o"), seq_len=7,
                      tokenizer="tests.tokenizer_support:lengths")  # fmt: skip
    longest = max(len(w) for w in WORDS)
    assert m.build["vocab_size"] == longest + 1 and m.sources["vocab_size_from"] == "max_id"
    assert m.dtype == "uint8" and int(_all_tokens(tmp_path / "o").max()) == longest
    assert not list((tmp_path / "o").glob(".spool*"))
    n = build_dataset([str(src)], str(tmp_path / "p"), seq_len=7, vocab_size=60000,
                      tokenizer="tests.tokenizer_support:lengths")  # fmt: skip
    assert n.dtype == "uint16" and n.sources["vocab_size_from"] == "--vocab-size"
    assert np.array_equal(_all_tokens(tmp_path / "o"), _all_tokens(tmp_path / "p"))


@pytest.mark.parametrize(
    "entry,message",
    [
        ("tests.no_such_module:words", "--tokenizer: cannot import module 'tests.no_such_module'"),
        ("tests.tokenizer_support:nope", "has no callable 'nope'"),
        ("tests.tokenizer_support", "must be module:function"),
        ("tests.tokenizer_support:floats", "must return a 1-D sequence of integers.*float64"),
        ("tests.tokenizer_support:strings", "must return a 1-D sequence of integers"),
        ("tests.tokenizer_support:negative", r"ids outside \[0, 2\*\*32\)"),
        ("tests.tokenizer_support:crashes", "raised RuntimeError: tokenizer crashed"),
        ("tests.tokenizer_support:wide", r"returned id 100, outside the vocabulary \[0, 10\)"),
    ],
)
def test_a_bad_tokenizer_is_a_clear_error_and_leaves_nothing_behind(
    tmp_path: Path, entry: str, message: str
) -> None:
    src = _corpus(tmp_path)
    with pytest.raises(DataError, match=message) as info:
        build_dataset([str(src)], str(tmp_path / "o"), seq_len=7, tokenizer=entry)
    if "import" not in message and "callable" not in message and "module:" not in message:
        assert "f00.txt" in str(info.value)  # names the source file it failed on
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_vocab_size_below_the_reported_one_and_non_utf8_text_are_refused(
    tmp_path: Path,
) -> None:
    src = _corpus(tmp_path)
    with pytest.raises(DataError, match="--vocab-size 5 is smaller than the vocab_size 11"):
        build_dataset([str(src)], str(tmp_path / "o"), tokenizer=ENTRY, vocab_size=5)
    (src / "d0" / "f00.txt").write_bytes(b"alpha \xff beta")
    with pytest.raises(DataError, match=r"f00\.txt: not UTF-8 text at byte 6"):
        build_dataset([str(src)], str(tmp_path / "o"), seq_len=3, tokenizer=ENTRY)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_a_real_bpe_tokenizer_from_a_local_file_builds_the_ids_it_encodes(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    src = _corpus(tmp_path)
    text = tmp_path / "train.txt"
    text.write_text("\n".join(f.read_text() for f in sorted(src.rglob("*.txt"))))
    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(text)], trainers.BpeTrainer(vocab_size=120, special_tokens=["[UNK]", "</s>"]))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    m = build_dataset([str(src)], str(tmp_path / "o"), seq_len=15, tokenizer_file=str(path),
                      tokenizer="perdure.data.hf:tokenizer_json")  # fmt: skip
    eos = tok.token_to_id("</s>")
    files = sorted(src.rglob("*.txt"), key=lambda f: f.relative_to(src).as_posix())
    want = np.array([i for f in files for i in [*tok.encode(f.read_text()).ids, eos]])
    got = _all_tokens(tmp_path / "o")
    assert np.array_equal(got, want[: got.size]) and want.size - got.size < 16
    assert m.build["vocab_size"] == tok.get_vocab_size() and m.build["separator"] == eos
    assert m.build["tokenizer_identity"]["reported"] == {"library": "tokenizers", "model": "BPE"}


def test_the_cli_builds_with_a_tokenizer_file_and_says_where_the_vocabulary_came_from(
    tmp_path: Path,
) -> None:
    src = _corpus(tmp_path)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(SPECIAL + WORDS) + "\n")
    out = tmp_path / "o"
    args = ["data", "build", str(src), "--out", str(out), "--seq-len", "15", "--tokenizer",
            "tests.tokenizer_support:from_vocab_file", "--tokenizer-file", str(vocab),
            "--vocab-size", "64"]  # fmt: skip
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 0, r.output
    assert "vocabulary: 64 (from --vocab-size)" in r.output and "version id: sha256:" in r.output
    built = json.loads((out / "manifest.json").read_text())
    assert built["build"]["vocab_size"] == 64 and built["build"]["separator"] == 1
    bad = CliRunner().invoke(main, ["data", "build", str(src), "--out", str(tmp_path / "x"),
                                    "--tokenizer", "tests.nope:f"])  # fmt: skip
    assert bad.exit_code == 1 and "cannot import module 'tests.nope'" in bad.output
    helped = CliRunner().invoke(main, ["data", "build", "--help"])
    assert "--tokenizer-file" in helped.output and "MiB" in helped.output
