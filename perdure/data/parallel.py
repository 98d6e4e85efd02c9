"""Tokenizing chunks of documents in worker processes, results in chunk order.

A build cuts its documents, in their fixed order, into *chunks* (about ``CHUNK_BYTES`` of
text, or ``CHUNK_DOCS`` documents, whichever comes first: a function of the documents
alone, never of the process count). Each chunk becomes one array, its documents' ids each
followed by the separator, computed in a worker; the builder consumes the arrays strictly
in chunk order. So the token stream, hence every part byte and the version id, is the
same for any number of processes: a process count only changes who computes a chunk.

Workers are ``spawn``-ed (never forked from a process that may hold threads and locks)
and end with the builder, however it ends (``lifecycle.die_with_parent``),
each loads the tokenizer once (an entry ``module:function`` and its file are loaded by
name; a Python callable must be picklable), and at most ``2 x processes`` chunks are in
flight, so memory stays bounded whatever the corpus size. A worker that dies (killed, out
of memory) fails the build with an error instead of a hang; a tokenizer error raised in a
worker is re-raised as it is (it names the source file).
"""

from __future__ import annotations

import multiprocessing
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import numpy as np

from perdure.data.errors import DataError
from perdure.data.tokenize import byte_tokenizer, check_tokens
from perdure.data.tokenizer_entry import EntryTokenizer, as_ids, load_tokenizer
from perdure.lifecycle import die_with_parent

CHUNK_BYTES = 1 << 20
CHUNK_DOCS = 4096


@dataclass(frozen=True)
class Item:
    """One document to tokenize: text (records) or bytes (a file), and its source name."""

    payload: str | bytes
    source: str
    final: bool = True
    """False for a file cut by ``max_mb``: a partial UTF-8 character at its end is dropped."""


@dataclass(frozen=True)
class Spec:
    """What a worker needs to tokenize: the tokenizer (by entry, or a picklable callable),
    the vocabulary to check ids against (None: unknown, ids only range-checked to 2**32),
    the separator and the dtype of the arrays it returns."""

    kind: str
    """``bytes``, ``entry`` or ``callable``."""
    entry: str | None
    file: str | None
    fn: Any
    vocab: int | None
    separator: int
    dtype: str


_TOKENIZER: Any = None


class WorkerDied(DataError):
    """A tokenizer worker process died: the build can be resumed (``--resume``)."""


def _init(spec: Spec, parent: int) -> None:
    global _TOKENIZER
    # A worker ends with the build: a builder killed with SIGKILL cannot shut its pool
    # down, and its workers, blocked on the pool's queue (one waiting for the queue's lock,
    # which the other holds), lived on forever (seen after a killed build's test).
    die_with_parent(parent)
    # One thread per worker: the process count is the parallelism (a tokenizers
    # encode_batch would otherwise start a thread per core in every worker).
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    _TOKENIZER = _load(spec)


def _load(spec: Spec) -> Any:
    if spec.kind == "entry":
        assert spec.entry is not None
        return load_tokenizer(spec.entry, spec.file)
    return spec.fn if spec.kind == "callable" else byte_tokenizer


def tokenize_chunk(spec: Spec, items: list[Item], tok: Any = None) -> np.ndarray:
    """The ids of ``items``, each document's followed by the separator, as ``spec.dtype``."""
    tok = _TOKENIZER if tok is None else tok
    sep = np.array([spec.separator], dtype=np.int64)
    parts: list[np.ndarray] = []
    for ids in _batch(spec, tok, items) or (_ids(spec, tok, it) for it in items):
        parts.append(ids)
        parts.append(sep)
    out = np.concatenate(parts) if parts else np.empty(0, np.int64)
    return out.astype(np.dtype(spec.dtype).newbyteorder("<"), copy=False)


def _batch(spec: Spec, tok: Any, items: list[Item]) -> list[np.ndarray] | None:
    """A chunk of records through the tokenizer's ``encode_batch`` when it has one (as
    :class:`perdure.data.hf.TokenizerJson` does), each document's ids checked as one by
    one; None: tokenize one by one."""
    batch = getattr(getattr(tok, "fn", None), "encode_batch", None)
    if spec.kind != "entry" or batch is None or not all(isinstance(i.payload, str) for i in items):
        return None
    try:
        out = batch([i.payload for i in items])
    except Exception as e:
        raise DataError(f"{items[0].source} and after: --tokenizer {tok.entry} raised "
                        f"{type(e).__name__}: {e}") from None  # fmt: skip
    if len(out) != len(items):
        raise DataError(f"--tokenizer {tok.entry}: encode_batch returned {len(out)} results "
                        f"for {len(items)} documents")  # fmt: skip
    return [_checked(spec, tok, it, as_ids(ids, f"{it.source}: --tokenizer {tok.entry}"))
            for it, ids in zip(items, out, strict=True)]  # fmt: skip


def _checked(spec: Spec, tok: Any, it: Item, ids: np.ndarray) -> np.ndarray:
    if spec.vocab is not None and ids.size and int(ids.max()) >= spec.vocab:
        raise DataError(f"{it.source}: --tokenizer {tok.entry} returned id {int(ids.max())}, "
                        f"outside the vocabulary [0, {spec.vocab})")  # fmt: skip
    return ids


def _ids(spec: Spec, tok: Any, it: Item) -> np.ndarray:
    if spec.kind == "bytes":
        data = it.payload.encode() if isinstance(it.payload, str) else it.payload
        return byte_tokenizer(data)
    if spec.kind == "callable":
        data = it.payload.encode() if isinstance(it.payload, str) else it.payload
        return check_tokens(tok(data), spec.vocab or 0, it.source)
    assert isinstance(tok, EntryTokenizer)
    if isinstance(it.payload, str):
        ids = tok.encode_text(it.payload, it.source)
    else:
        ids = tok.encode(it.payload, it.source, final=it.final)
    return _checked(spec, tok, it, ids)


def run_chunks(
    spec: Spec,
    chunks: Iterable[tuple[list[Item], Any]],
    processes: int,
    consume: Callable[[np.ndarray, Any], None],
    local: Any = None,
) -> None:
    """Tokenize every chunk (``(items, tag)``) and call ``consume(ids, tag)`` in chunk
    order. ``processes == 1`` runs in this process with ``local`` (the loaded tokenizer)."""
    if processes == 1:
        tok = local if local is not None else _load(spec)
        for items, tag in chunks:
            consume(tokenize_chunk(spec, items, tok), tag)
        return
    ctx = multiprocessing.get_context("spawn")
    pending: deque[tuple[Future[np.ndarray], Any]] = deque()
    with ProcessPoolExecutor(processes, mp_context=ctx, initializer=_init,
                             initargs=(spec, os.getpid())) as pool:  # fmt: skip
        try:
            for head in _bounded(chunks, pending, pool, spec, 2 * processes):
                consume(head[0].result(), head[1])
            while pending:
                fut, tag = pending.popleft()
                consume(fut.result(), tag)
        except BrokenProcessPool as e:
            raise WorkerDied(f"build: a tokenizer worker process died ({e}); "
                            "the build can be resumed with --resume") from None  # fmt: skip
        finally:
            for fut, _ in pending:
                fut.cancel()


def _bounded(
    chunks: Iterable[tuple[list[Item], Any]],
    pending: deque[tuple[Future[np.ndarray], Any]],
    pool: ProcessPoolExecutor,
    spec: Spec,
    limit: int,
) -> Iterator[tuple[Future[np.ndarray], Any]]:
    """Submit chunks, yielding the oldest pending one whenever ``limit`` are in flight."""
    for items, tag in chunks:
        pending.append((pool.submit(tokenize_chunk, spec, items), tag))
        if len(pending) >= limit:
            yield pending.popleft()
