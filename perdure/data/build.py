"""``build_dataset``: text sources -> tokens -> fixed-length samples -> shards + manifest.

The token stream is every source file's tokens followed by one separator token, files in
the order of :func:`~perdure.data.sources.list_sources`. It is cut into consecutive,
non-overlapping samples of ``seq_len + 1`` tokens (the model reads ``[:-1]`` and predicts
``[1:]``); the last partial sample is dropped. Samples fill shards of ``samples_per_shard``
rows, ``floor(shard_mb MiB / row bytes)``; the last shard may hold fewer.

Tokenizers: byte-level by default; a Python callable ``bytes -> ids`` with ``vocab_size``;
or an import entry ``module:function`` (``perdure data build --tokenizer``, see
:mod:`perdure.data.tokenizer_entry`), whose vocabulary is what it reports, or
``vocab_size``, or else the largest id seen + 1 (then the ids are spooled to a temporary
file first, since the shards' dtype depends on that largest id).

Everything is a pure function of the file contents and the parameters, so the same inputs
give byte-identical shards and the same version id anywhere. The build writes into a
temporary sibling directory and renames it into place: a reader never sees half a dataset.
Limits: the output must be a local directory (upload it with any tool afterwards: shards
are plain files); the build reads sources one at a time and holds one shard in memory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from perdure.data.errors import DataError
from perdure.data.hashing import sha256_hex
from perdure.data.manifest import Manifest, ShardInfo
from perdure.data.output import commit, staged, write_file
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
from perdure.data.tokenizer_entry import EntryTokenizer, load_tokenizer

MiB = 1 << 20
SPOOL_CHUNK = 1 << 24
"""Tokens read back from the spool at a time (64 MiB of uint32)."""


def build_dataset(
    sources: list[str],
    out: str,
    *,
    seq_len: int = 128,
    shard_mb: float = 64.0,
    tokenizer: Tokenizer | EntryTokenizer | str | None = None,
    tokenizer_file: str | None = None,
    vocab_size: int | None = None,
    separator: int | None = None,
    include: str = "*",
    max_mb: float | None = None,
    overwrite: bool = False,
) -> Manifest:
    """Build a dataset from ``sources`` into the directory ``out``; return its manifest.

    ``tokenizer`` maps a file's bytes to token ids (default: bytes, vocab 256; a Python
    callable needs ``vocab_size``), or is an entry ``module:function`` (or an
    :class:`EntryTokenizer`) mapping text to ids, with ``tokenizer_file`` handed to it
    when given. ``separator``: the token after each document (default 0, or an entry
    tokenizer's ``eos_id``). ``include`` filters file names found in directories.
    ``max_mb`` caps the source bytes read (files in order, the last one truncated).
    ``overwrite`` replaces an existing ``out``; otherwise an existing ``out`` is an error.
    """
    _check_args(seq_len, shard_mb, max_mb)
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer, tokenizer_file)
    elif tokenizer_file is not None:
        raise DataError(f"build: tokenizer_file ({tokenizer_file!r}) needs tokenizer as an "
                        "entry string, module:function, to hand the file to")  # fmt: skip
    plan = _plan(tokenizer, vocab_size, separator)
    with staged(out, overwrite, "build") as tmp:
        files = list_sources(sources, include)
        if plan.vocab is None:
            spool = _Spool(tmp / ".spool")
            stats = _feed(files, spool, plan, max_mb)
            plan.vocab = max(spool.max_id, plan.separator) + 1
            writer = _ShardWriter(tmp, dtype_for(plan.vocab), seq_len + 1, shard_mb)
            spool.replay(writer)
        else:
            writer = _ShardWriter(tmp, dtype_for(plan.vocab), seq_len + 1, shard_mb)
            stats = _feed(files, writer, plan, max_mb)
        stats["tokens"] = writer.tokens_in
        shards = writer.finish()
        build: dict[str, Any] = {
            "seq_len": seq_len,
            "samples_per_shard": writer.per_shard,
            "tokenizer": plan.name,
            "vocab_size": plan.vocab,
            "separator": plan.separator,
        }
        if plan.identity:
            build["tokenizer_identity"] = plan.identity
        if plan.vocab_from is not None:
            stats["vocab_size_from"] = plan.vocab_from
        manifest = Manifest(seq_len, writer.dtype_name, tuple(shards), build, stats)
        manifest = manifest.with_version_id()
        commit(tmp, out, manifest)
    return manifest


class _Plan:
    """How the sources become ids: the tokenizer, its name, vocabulary and separator."""

    def __init__(self, name: str, encode: Any, vocab: int | None, separator: int) -> None:
        self.name, self.encode, self.vocab, self.separator = name, encode, vocab, separator
        self.identity: dict[str, Any] = {}
        self.vocab_from: str | None = None
        """For an entry tokenizer: where the vocabulary came from (informational)."""


def _plan(tok: Tokenizer | EntryTokenizer | None, vocab: int | None, sep: int | None) -> _Plan:
    if isinstance(tok, EntryTokenizer):
        return _entry_plan(tok, vocab, sep)
    if tok is not None and tok is not byte_tokenizer and vocab is None:
        raise DataError("build: a custom tokenizer needs vocab_size (got None)")
    vocab = BYTE_VOCAB if vocab is None else vocab
    if vocab < 1:
        raise DataError(f"build: vocab_size must be >= 1 (got {vocab})")
    dtype_for(vocab)  # raises for a vocabulary past 2**32
    sep = SEPARATOR if sep is None else sep
    if not 0 <= sep < vocab:
        raise DataError(f"build: separator must be in [0, {vocab}) (got {sep})")
    return _Plan(tokenizer_name(tok), tok or byte_tokenizer, vocab, sep)


def _entry_plan(tok: EntryTokenizer, vocab: int | None, sep: int | None) -> _Plan:
    reported, flag = tok.vocab_size, vocab
    if flag is not None:
        if not 1 <= flag <= 2**32:
            raise DataError(f"build: --vocab-size must be in [1, 2**32] (got {flag})")
        if reported is not None and flag < reported:
            raise DataError(f"build: --vocab-size {flag} is smaller than the vocab_size "
                            f"{reported} that --tokenizer {tok.entry} reports")  # fmt: skip
    chosen = flag if flag is not None else reported
    sep = sep if sep is not None else (tok.eos_id if tok.eos_id is not None else SEPARATOR)
    bound = chosen if chosen is not None else 2**32
    if not 0 <= sep < bound:
        raise DataError(f"build: separator must be in [0, {bound}) (got {sep})")
    plan = _Plan(tok.entry, tok, chosen, sep)
    plan.identity = tok.identity
    plan.vocab_from = "--vocab-size" if flag is not None else (
        "tokenizer" if reported is not None else "max_id")  # fmt: skip
    return plan


def _check_args(seq_len: int, shard_mb: float, max_mb: float | None) -> None:
    if seq_len < 1:
        raise DataError(f"build: seq_len must be >= 1 (got {seq_len})")
    if not shard_mb > 0:
        raise DataError(f"build: shard_mb must be > 0 (got {shard_mb})")
    if max_mb is not None and not max_mb > 0:
        raise DataError(f"build: max_mb must be > 0 (got {max_mb})")


def _feed(files: list[Path], sink: Any, plan: _Plan, max_mb: float | None) -> dict[str, Any]:
    """Tokenize ``files`` in order into ``sink`` (a shard writer or a spool), a separator
    after each; ids are checked against the vocabulary as they come."""
    budget = None if max_mb is None else int(max_mb * MiB)
    sep = np.array([plan.separator], dtype=np.int64)
    used, read = 0, 0
    for f in files:
        data = f.read_bytes()
        cut = budget is not None and len(data) > budget - read
        if budget is not None:
            data = data[: budget - read]
        read += len(data)
        sink.add(_ids(plan, data, str(f), final=not cut))
        sink.add(sep)
        used += 1
        if budget is not None and read >= budget:
            break
    return {"files": used, "bytes": read}


def _ids(plan: _Plan, data: bytes, source: str, final: bool) -> np.ndarray:
    if plan.encode is byte_tokenizer:
        return byte_tokenizer(data)
    if isinstance(plan.encode, EntryTokenizer):
        ids = plan.encode.encode(data, source, final=final)
        if plan.vocab is None:
            return ids  # range-checked against 2**32 already; the vocabulary is max + 1
        if ids.size and int(ids.max()) >= plan.vocab:
            raise DataError(f"{source}: --tokenizer {plan.name} returned id {int(ids.max())}, "
                            f"outside the vocabulary [0, {plan.vocab})")  # fmt: skip
        return ids
    return check_tokens(plan.encode(data), plan.vocab or 0, source)


class _Spool:
    """Ids of a build whose vocabulary is not known up front, as uint32 in a temporary
    file inside the build directory (removed before the commit)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.f = open(path, "wb")  # noqa: SIM115 (closed in replay or with the build dir)
        self.max_id = -1

    def add(self, ids: np.ndarray) -> None:
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
            self.f.write(ids.astype("<u4").tobytes())

    def replay(self, writer: _ShardWriter) -> None:
        self.f.close()
        if self.path.stat().st_size:
            stream = np.memmap(self.path, dtype="<u4", mode="r")
            for start in range(0, stream.size, SPOOL_CHUNK):
                writer.add(np.asarray(stream[start : start + SPOOL_CHUNK]))
            del stream
        self.path.unlink()


class _ShardWriter:
    """Accumulates tokens and writes full shards as raw little-endian row-major arrays."""

    def __init__(self, root: Path, dtype: str, row_tokens: int, shard_mb: float) -> None:
        self.root, self.row, self.dtype_name = root, row_tokens, dtype
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.per_shard = max(1, int(shard_mb * MiB) // (row_tokens * self.dtype.itemsize))
        self.chunks: list[np.ndarray] = []
        self.pending = 0
        self.tokens_in = 0
        self.shards: list[ShardInfo] = []

    def add(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
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
        write_file(self.root / name, data)
        self.shards.append(ShardInfo(name, tokens.size // self.row, len(data), sha256_hex(data)))
