"""``build_dataset``: text sources -> tokens -> fixed-length samples -> shards + manifest.

The token stream is every source file's tokens followed by one separator token, files in
the order of :func:`~perdure.data.sources.list_sources`. It is cut into consecutive,
non-overlapping samples of ``seq_len + 1`` tokens (the model reads ``[:-1]`` and predicts
``[1:]``); the last partial sample is dropped. Samples fill shards of ``samples_per_shard``
rows, ``floor(shard_mb MiB / row bytes)``; the last shard may hold fewer.

Everything is a pure function of the file contents and the parameters, so the same inputs
give byte-identical shards and the same version id anywhere. The build writes into a
temporary sibling directory and renames it into place: a reader never sees half a dataset.
Limits: the output must be a local directory (upload it with any tool afterwards: shards
are plain files); the build reads sources one at a time and holds one shard in memory.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from perdure.data.errors import DataError
from perdure.data.hashing import sha256_hex
from perdure.data.manifest import MANIFEST_NAME, Manifest, ShardInfo
from perdure.data.sources import list_sources
from perdure.data.tokenize import (
    BYTE_VOCAB,
    SEPARATOR,
    Tokenizer,
    byte_tokenizer,
    check_tokens,
    dtype_for,
    tokenizer_name,
)

MiB = 1 << 20


def build_dataset(
    sources: list[str],
    out: str,
    *,
    seq_len: int = 128,
    shard_mb: float = 64.0,
    tokenizer: Tokenizer | None = None,
    vocab_size: int | None = None,
    separator: int = SEPARATOR,
    include: str = "*",
    max_mb: float | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Build a dataset from ``sources`` into the directory ``out``; return its manifest.

    ``tokenizer`` maps a file's bytes to token ids (default: bytes, vocab 256; a custom
    tokenizer needs ``vocab_size``). ``include`` filters file names found in directories.
    ``max_mb`` caps the source bytes read (files in order, the last one truncated).
    ``overwrite`` replaces an existing ``out``; otherwise an existing ``out`` is an error.
    """
    vocab = _check_args(seq_len, shard_mb, tokenizer, vocab_size, separator, max_mb)
    dest = Path(out)
    if dest.exists() and not overwrite:
        raise DataError(f"build: output {dest} already exists (pass overwrite=True / --force)")
    files = list_sources(sources, include)
    dtype = dtype_for(vocab)
    row_tokens = seq_len + 1
    per_shard = max(1, int(shard_mb * MiB) // (row_tokens * np.dtype(dtype).itemsize))
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        writer = _ShardWriter(tmp, dtype, row_tokens, per_shard)
        stats = _feed(files, writer, tokenizer or byte_tokenizer, vocab, separator, max_mb)
        shards = writer.finish()
        build = {
            "seq_len": seq_len,
            "samples_per_shard": per_shard,
            "tokenizer": tokenizer_name(tokenizer),
            "vocab_size": vocab,
            "separator": separator,
        }
        manifest = Manifest(seq_len, dtype, tuple(shards), build, stats).with_version_id()
        _write_file(tmp / MANIFEST_NAME, manifest.to_json().encode())
        _commit(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _check_args(
    seq_len: int,
    shard_mb: float,
    tokenizer: Tokenizer | None,
    vocab_size: int | None,
    separator: int,
    max_mb: float | None,
) -> int:
    if seq_len < 1:
        raise DataError(f"build: seq_len must be >= 1 (got {seq_len})")
    if not shard_mb > 0:
        raise DataError(f"build: shard_mb must be > 0 (got {shard_mb})")
    if max_mb is not None and not max_mb > 0:
        raise DataError(f"build: max_mb must be > 0 (got {max_mb})")
    if tokenizer is not None and tokenizer is not byte_tokenizer and vocab_size is None:
        raise DataError("build: a custom tokenizer needs vocab_size (got None)")
    vocab = BYTE_VOCAB if vocab_size is None else vocab_size
    if vocab < 1:
        raise DataError(f"build: vocab_size must be >= 1 (got {vocab})")
    if not 0 <= separator < vocab:
        raise DataError(f"build: separator must be in [0, {vocab}) (got {separator})")
    return vocab


def _feed(
    files: list[Path],
    writer: _ShardWriter,
    tokenizer: Tokenizer,
    vocab: int,
    separator: int,
    max_mb: float | None,
) -> dict[str, int]:
    budget = None if max_mb is None else int(max_mb * MiB)
    sep = np.array([separator], dtype=writer.dtype)
    used, read = 0, 0
    for f in files:
        data = f.read_bytes()
        if budget is not None:
            data = data[: budget - read]
        read += len(data)
        ids = tokenizer(data) if tokenizer is byte_tokenizer else check_tokens(
            tokenizer(data), vocab, str(f))  # fmt: skip
        writer.add(ids.astype(writer.dtype, copy=False))
        writer.add(sep)
        used += 1
        if budget is not None and read >= budget:
            break
    return {"files": used, "bytes": read, "tokens": writer.tokens_in}


class _ShardWriter:
    """Accumulates tokens and writes full shards as raw little-endian row-major arrays."""

    def __init__(self, root: Path, dtype: str, row_tokens: int, per_shard: int) -> None:
        self.root, self.row, self.per_shard = root, row_tokens, per_shard
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.chunks: list[np.ndarray] = []
        self.pending = 0
        self.tokens_in = 0
        self.shards: list[ShardInfo] = []

    def add(self, ids: np.ndarray) -> None:
        self.chunks.append(ids)
        self.pending += ids.size
        self.tokens_in += ids.size
        shard_tokens = self.row * self.per_shard
        if self.pending >= shard_tokens:
            flat = np.concatenate(self.chunks)
            full = (flat.size // shard_tokens) * shard_tokens
            for start in range(0, full, shard_tokens):
                self._write(flat[start : start + shard_tokens])
            rest = flat[full:]
            self.chunks, self.pending = [rest], rest.size

    def finish(self) -> list[ShardInfo]:
        flat = np.concatenate(self.chunks) if self.chunks else np.empty(0, self.dtype)
        usable = (flat.size // self.row) * self.row
        if usable:
            self._write(flat[:usable])
        if not self.shards:
            raise DataError(
                f"build: sources hold {self.tokens_in} tokens, fewer than one sample of "
                f"seq_len + 1 = {self.row} tokens"
            )
        return self.shards

    def _write(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        name = f"shard-{len(self.shards):05d}.bin"
        _write_file(self.root / name, data)
        self.shards.append(ShardInfo(name, tokens.size // self.row, len(data), sha256_hex(data)))


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _commit(tmp: Path, dest: Path) -> None:
    """Rename ``tmp`` to ``dest``; an existing ``dest`` is moved aside first, then removed."""
    old = None
    if dest.exists():
        old = dest.parent / f".{dest.name}.old-{os.getpid()}-{time.time_ns()}"
        os.rename(dest, old)
    os.rename(tmp, dest)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
