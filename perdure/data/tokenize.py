"""The built-in byte-level tokenizer, and the checks every tokenizer's output must pass.

Byte-level: token id = byte value, vocabulary 256, no training, no files, identical on
every machine. A tokenizer hook is any callable ``bytes -> 1-D integer array``; what it
returns is checked (integer, 1-D, ids in ``[0, vocab_size)``) so that a bad tokenizer fails
the build naming the source file instead of writing a silently wrong dataset.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from perdure.data.errors import DataError

Tokenizer = Callable[[bytes], np.ndarray]

BYTE_VOCAB = 256
SEPARATOR = 0
"""Token appended after every document (source file). Byte 0 (NUL) does not occur in text,
so for the byte tokenizer it is an unambiguous document boundary; a source that contains
NUL bytes is still accepted, its NULs are then indistinguishable from boundaries."""


def byte_tokenizer(data: bytes) -> np.ndarray:
    """Token id = byte; zero-copy view of ``data``."""
    return np.frombuffer(data, dtype=np.uint8)


def tokenizer_name(tokenizer: Tokenizer | None) -> str:
    """Name recorded in the manifest (``bytes`` or ``module.qualname``)."""
    if tokenizer is None or tokenizer is byte_tokenizer:
        return "bytes"
    module = getattr(tokenizer, "__module__", "?")
    return f"{module}.{getattr(tokenizer, '__qualname__', type(tokenizer).__name__)}"


def dtype_for(vocab_size: int) -> str:
    """Smallest little-endian unsigned dtype that holds ids ``< vocab_size``."""
    for name, bound in (("uint8", 1 << 8), ("uint16", 1 << 16), ("uint32", 1 << 32)):
        if vocab_size <= bound:
            return name
    raise DataError(f"build: vocab_size must be <= 2**32 (got {vocab_size})")


def check_tokens(ids: object, vocab_size: int, file: str) -> np.ndarray:
    """Validate one document's token ids; raise naming ``file`` and the rule broken."""
    arr = np.asarray(ids)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise DataError(
            f"{file}: tokenizer must return a 1-D integer array "
            f"(got dtype {arr.dtype}, shape {arr.shape})"
        )
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= vocab_size):
        lo, hi = int(arr.min()), int(arr.max())
        raise DataError(f"{file}: token ids must be in [0, {vocab_size}) (got [{lo}, {hi}])")
    return arr
