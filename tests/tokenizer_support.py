"""Tokenizers for the build tests, named by entry (``tests.tokenizer_support:NAME``), the
way a user names theirs: small, deterministic, and a few broken on purpose."""

from __future__ import annotations

from pathlib import Path

import numpy as np

WORDS = ["alpha", "beta", "gamma", "delta", "shard", "slot", "step", "epoch", "perdure"]
"""The vocabulary of tests.unit.test_data_support.write_corpus, after the special ids."""
SPECIAL = ["<unk>", "<eos>"]


class WordLevel:
    """Whitespace words -> ids from a vocabulary (one word a line); unknown -> 0."""

    def __init__(self, vocab: list[str]) -> None:
        self.ids = {w: i for i, w in enumerate(vocab)}
        self.vocab_size = len(vocab)
        self.eos_id = self.ids.get("<eos>")
        self.identity = {"kind": "word-level", "words": len(vocab)}

    def __call__(self, text: str) -> list[int]:
        return [self.ids.get(w, 0) for w in text.split()]


def words(text: str) -> list[int]:
    """The built-in vocabulary, as a plain function with attributes."""
    return _WORDS(text)


_WORDS = WordLevel(SPECIAL + WORDS)
words.vocab_size = _WORDS.vocab_size  # type: ignore[attr-defined]
words.eos_id = _WORDS.eos_id  # type: ignore[attr-defined]


def from_vocab_file(path: str) -> WordLevel:
    """Factory for --tokenizer-file: a vocabulary file, one word a line."""
    return WordLevel(Path(path).read_text().split())


def lengths(text: str) -> np.ndarray:
    """Word lengths: reports no vocabulary (the build takes the largest id + 1)."""
    return np.array([len(w) for w in text.split()], dtype=np.int32)


def floats(text: str) -> list[float]:
    return [float(len(w)) for w in text.split()]


def strings(text: str) -> list[str]:
    return text.split()


def negative(text: str) -> list[int]:
    return [-1 for _ in text.split()]


def crashes(text: str) -> list[int]:
    raise RuntimeError("tokenizer crashed")


def wide(text: str) -> list[int]:
    """Ids past what it reports (vocab_size 10)."""
    return [100 for _ in text.split()]


wide.vocab_size = 10  # type: ignore[attr-defined]


def slow_bytes(text: str) -> list[int]:
    """UTF-8 bytes, slowly (1 ms a document): a build long enough to be killed midway."""
    import time

    time.sleep(0.001)
    return list(text.encode())


slow_bytes.vocab_size = 256  # type: ignore[attr-defined]
