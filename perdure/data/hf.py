"""An adapter for a Hugging Face ``tokenizers`` tokenizer loaded from a local file.

``perdure data build SRC --tokenizer perdure.data.hf:tokenizer_json --tokenizer-file
tokenizer.json`` tokenizes with a ``tokenizers`` tokenizer (BPE, WordPiece, WordLevel,
Unigram) saved as ``tokenizer.json``: no download, ever. It needs the ``tokenizers``
package (``pip install perdure[tokenizers]``); perdure itself does not depend on it.
Special tokens are not added (a document's ids are its text's); the separator between
documents is the tokenizer's end-of-text token when its vocabulary has one of
``EOS_NAMES``, else ``--separator`` (default 0). A ``transformers`` tokenizer takes a
three-line module of one's own (``docs/data.md``).
"""

from __future__ import annotations

from perdure.data.errors import DataError

EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "[SEP]", "<|end_of_text|>")
"""Tokens taken as end-of-text, first match wins, when a tokenizer.json names none."""


class TokenizerJson:
    """A ``tokenizers.Tokenizer`` from one ``tokenizer.json``: text -> ids."""

    def __init__(self, path: str) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise DataError(
                "--tokenizer perdure.data.hf:tokenizer_json needs the "
                "`tokenizers` package (pip install perdure[tokenizers])"
            ) from None
        try:
            self.tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise DataError(
                f"{path}: not a tokenizer.json the tokenizers library can load ({e})"
            ) from None
        self.vocab_size = int(self.tok.get_vocab_size(with_added_tokens=True))
        self.eos_id = next(
            (i for t in EOS_NAMES if (i := self.tok.token_to_id(t)) is not None), None
        )
        self.identity = {"library": "tokenizers", "model": type(self.tok.model).__name__}

    def __call__(self, text: str) -> list[int]:
        return list(self.tok.encode(text, add_special_tokens=False).ids)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many documents in one call (the build hands it a chunk's records): the same ids
        as calling it on each, with less overhead per document."""
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]


def tokenizer_json(path: str) -> TokenizerJson:
    """Factory for ``--tokenizer-file tokenizer.json``."""
    return TokenizerJson(path)
