"""``build_dataset``: text sources -> tokens -> fixed-length samples -> parts + manifest.

The token stream is every source file's tokens followed by one separator token, files in
the order of :func:`~perdure.data.sources.list_sources`. It is cut into consecutive,
non-overlapping samples of ``seq_len + 1`` tokens (the model reads ``[:-1]`` and predicts
``[1:]``); the last partial sample is dropped. Samples fill parts of ``samples_per_part``
rows, ``floor(part_mb MiB / row bytes)``; the last part may hold fewer.

Tokenizers: byte-level by default; a Python callable ``bytes -> ids`` with ``vocab_size``;
or an import entry ``module:function`` (``perdure data build --tokenizer``, see
:mod:`perdure.data.tokenizer_entry`), whose vocabulary is what it reports, or
``vocab_size``, or else the largest id seen + 1 (then the ids are spooled to a temporary
file first, since the parts' dtype depends on that largest id).

Everything is a pure function of the file contents and the parameters, so the same inputs
give byte-identical parts and the same version id anywhere. The build writes into a
temporary sibling directory and renames it into place: a reader never sees half a dataset.
Limits: the output must be a local directory (upload it with any tool afterwards: parts
are plain files); the build reads sources one at a time and holds one part in memory.
"""

from __future__ import annotations

import pickle
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from perdure.data.errors import DataError
from perdure.data.hashing import sha256_hex
from perdure.data.manifest import Manifest, PartInfo
from perdure.data.output import commit, write_file
from perdure.data.parallel import CHUNK_BYTES, CHUNK_DOCS, Item, Spec, WorkerDied, run_chunks
from perdure.data.records import Skipped, iter_docs, list_record_sources
from perdure.data.resume import check_state, fingerprint, open_partial, save_state
from perdure.data.sources import list_sources
from perdure.data.tokenize import (
    BYTE_VOCAB,
    SEPARATOR,
    Tokenizer,
    byte_tokenizer,
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
    part_mb: float = 64.0,
    tokenizer: Tokenizer | EntryTokenizer | str | None = None,
    tokenizer_file: str | None = None,
    vocab_size: int | None = None,
    separator: int | None = None,
    include: str = "*",
    max_mb: float | None = None,
    overwrite: bool = False,
    text_field: str | None = None,
    skip_bad_records: bool = False,
    processes: int = 1,
    resume: bool = False,
    progress: Callable[[Progress], None] | None = None,
    say: Callable[[str], None] | None = None,
) -> Manifest:
    """Build a dataset from ``sources`` into the directory ``out``; return its manifest.

    ``tokenizer`` maps a file's bytes to token ids (default: bytes, vocab 256; a Python
    callable needs ``vocab_size``), or is an entry ``module:function`` (or an
    :class:`EntryTokenizer`) mapping text to ids, with ``tokenizer_file`` handed to it
    when given. ``separator``: the token after each document (default 0, or an entry
    tokenizer's ``eos_id``). ``include`` filters file names found in directories.
    ``max_mb`` caps the source bytes read (files in order, the last one truncated; with
    ``text_field``, the text of whole records). ``overwrite`` replaces an existing ``out``.

    ``text_field``: the sources are records (JSON Lines, Parquet, ``datasets``
    directories; :mod:`perdure.data.records`) and this field of each is one document;
    ``skip_bad_records`` counts a bad record instead of failing. ``processes``: worker
    processes that tokenize (the output is the same for any count; a Python callable
    tokenizer must then be picklable). ``resume``: continue an interrupted build of the
    same sources and parameters (:mod:`perdure.data.resume`). ``progress`` is called after
    every chunk; ``say`` receives one-line notes (default: none).
    """
    _check_args(seq_len, part_mb, max_mb)
    if isinstance(processes, bool) or not isinstance(processes, int) or processes < 1:
        raise DataError(f"build: --processes must be an integer >= 1 (got {processes!r})")
    entry_file = tokenizer_file
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer, tokenizer_file)
    elif tokenizer_file is not None:
        raise DataError(f"build: tokenizer_file ({tokenizer_file!r}) needs tokenizer as an "
                        "entry string, module:function, to hand the file to")  # fmt: skip
    plan = _plan(tokenizer, vocab_size, separator)
    if Path(out).exists() and not overwrite:
        raise DataError(f"build: output {out} already exists (pass overwrite=True / --force)")
    paths = list_record_sources(sources) if text_field else list_sources(sources, include)
    spec = _spec(plan, tokenizer, entry_file, processes)
    # "shard_mb": the key before the rename, so that a build interrupted then still resumes
    params = {"seq_len": seq_len, "shard_mb": part_mb, "tokenizer": plan.name,
              "identity": plan.identity, "vocab": plan.vocab, "separator": plan.separator,
              "text_field": text_field, "skip_bad": skip_bad_records, "max_mb": max_mb}  # fmt: skip
    fp = fingerprint(params, paths)
    work, state = open_partial(out, resume, say or (lambda _m: None))
    if state is not None:
        check_state(state, fp, work)
    run = _Run(work, fp, plan, spec, seq_len, part_mb, state, progress)
    try:
        total = float(sum(_size(p) for p in paths))
        if text_field:
            stats = run.records(paths, text_field, skip_bad_records, max_mb, total, processes)
        else:
            stats = run.files(paths, max_mb, total, processes)
        manifest = run.finish(stats)
    except WorkerDied:
        raise  # resumable: the work directory stays
    except Exception:  # bad input or a bad tokenizer: nothing to resume into
        shutil.rmtree(work, ignore_errors=True)
        raise
    # KeyboardInterrupt, SystemExit (and a SIGKILL) leave the work directory for --resume
    commit(work, out, manifest)
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


def _check_args(seq_len: int, part_mb: float, max_mb: float | None) -> None:
    if seq_len < 1:
        raise DataError(f"build: seq_len must be >= 1 (got {seq_len})")
    if not part_mb > 0:
        raise DataError(f"build: part_mb must be > 0 (got {part_mb})")
    if max_mb is not None and not max_mb > 0:
        raise DataError(f"build: max_mb must be > 0 (got {max_mb})")


@dataclass(frozen=True)
class Progress:
    """How far a build is, after each chunk: for a progress bar and an ETA."""

    done_bytes: float
    """Source bytes read (on disk; an estimate inside a compressed or columnar file)."""
    total_bytes: float
    documents: int
    tokens: int


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _spec(plan: _Plan, tok: Any, file: str | None, processes: int) -> Spec:
    dtype = dtype_for(plan.vocab) if plan.vocab is not None else "uint32"
    if isinstance(plan.encode, EntryTokenizer):
        return Spec("entry", plan.encode.entry, file, None, plan.vocab, plan.separator, dtype)
    if plan.encode is byte_tokenizer:
        return Spec("bytes", None, None, None, plan.vocab, plan.separator, dtype)
    if processes > 1:
        try:
            pickle.dumps(plan.encode)
        except Exception as e:
            raise DataError(f"build: a tokenizer callable must be picklable for processes > 1 "
                            f"({plan.name}: {e}); pass processes=1") from None  # fmt: skip
    return Spec("callable", None, None, plan.encode, plan.vocab, plan.separator, dtype)


class _Run:
    """One build in its work directory: chunks in, parts (or the spool) out, state saved
    after every chunk so that ``--resume`` can go on from there."""

    def __init__(self, work: Path, fp: str, plan: _Plan, spec: Spec, seq_len: int,
                 part_mb: float, state: dict[str, Any] | None,
                 progress: Callable[[Progress], None] | None) -> None:  # fmt: skip
        self.work, self.fp, self.plan, self.spec = work, fp, plan, spec
        self.seq_len, self.part_mb, self.progress = seq_len, part_mb, progress
        self.state = state or {}
        sink_state = self.state.get("sink")
        self.sink: _Spool | _PartWriter
        if plan.vocab is None:
            self.sink = _Spool(work / ".spool", sink_state)
        else:
            self.sink = _PartWriter(work, dtype_for(plan.vocab), seq_len + 1, part_mb,
                                     sink_state)  # fmt: skip
        self.stats: dict[str, Any] = dict(self.state.get("stats", {}))
        self.total = 0.0
        self.local = plan.encode if isinstance(plan.encode, EntryTokenizer) else None

    def files(
        self, paths: list[Path], max_mb: float | None, total: float, procs: int
    ) -> dict[str, Any]:
        """Each file is one document (bytes; decoded by a text tokenizer)."""
        self.total = total
        done = int(self.state.get("records", 0))
        read0 = int(self.stats.get("bytes", 0))
        budget = None if max_mb is None else int(max_mb * MiB)

        def items() -> Iterator[tuple[Item, dict[str, Any]]]:
            read = read0
            for i, f in enumerate(paths[done:], done + 1):
                if budget is not None and read >= budget:
                    return
                data = f.read_bytes()
                cut = budget is not None and len(data) > budget - read
                if budget is not None:
                    data = data[: budget - read]
                read += len(data)
                yield Item(data, str(f), final=not cut), {"records": i, "stats": {
                    "files": i, "bytes": read}, "done": float(read)}  # fmt: skip

        run_chunks(self.spec, _chunked(items()), procs, self._consume, self.local)
        return {"files": int(self.stats.get("files", 0)), "bytes": int(self.stats.get("bytes", 0))}

    def records(self, paths: list[Path], field: str, skip_bad: bool, max_mb: float | None,
                total: float, procs: int) -> dict[str, Any]:  # fmt: skip
        """Each record's ``field`` is one document (:mod:`perdure.data.records`)."""
        self.total = total
        done = int(self.state.get("records", 0))
        skipped = Skipped(**self.state["skipped"]) if "skipped" in self.state else Skipped()
        budget = None if max_mb is None else int(max_mb * MiB)
        docs0, text0 = int(self.stats.get("documents", 0)), int(self.stats.get("text_bytes", 0))

        def items() -> Iterator[tuple[Item, dict[str, Any]]]:
            n, text = docs0, text0
            for d in iter_docs(paths, field, skipped if skip_bad else None, skip=done):
                if budget is not None and text >= budget:
                    return
                n += 1
                if budget is not None:
                    text += len(d.text.encode())
                yield Item(d.text, f"{d.source}: row {d.row}"), {
                    "records": d.seq, "skipped": skipped.to_dict(), "done": d.done,
                    "stats": {"documents": n, "text_bytes": text}}  # fmt: skip

        run_chunks(self.spec, _chunked(items()), procs, self._consume, self.local)
        out: dict[str, Any] = {
            "files": len(paths),
            "bytes": int(total),
            "documents": int(self.stats.get("documents", 0)),
            "text_field": field,
        }
        if skip_bad:
            out["skipped_records"] = skipped.to_dict()
        return out

    def _consume(self, ids: np.ndarray, tag: dict[str, Any]) -> None:
        self.sink.add(ids)
        self.sink.checkpoint()
        self.stats.update(tag["stats"])
        state = {"fingerprint": self.fp, "records": tag["records"], "stats": self.stats,
                 "sink": self.sink.state()}  # fmt: skip
        if "skipped" in tag:
            state["skipped"] = tag["skipped"]
        save_state(self.work, state)
        self.sink.saved()
        if self.progress is not None:
            docs = int(self.stats.get("documents", self.stats.get("files", 0)))
            self.progress(Progress(tag["done"], self.total, docs, self.sink.tokens_in))

    def finish(self, stats: dict[str, Any]) -> Manifest:
        plan, sink = self.plan, self.sink
        if isinstance(sink, _Spool):
            plan.vocab = max(sink.max_id, plan.separator) + 1
            writer = _PartWriter(self.work, dtype_for(plan.vocab), self.seq_len + 1,
                                  self.part_mb, None, journal=False)  # fmt: skip
            sink.replay(writer)
        else:
            writer = sink
        stats["tokens"] = writer.tokens_in
        parts = writer.finish()
        build: dict[str, Any] = {
            "seq_len": self.seq_len,
            "samples_per_shard": writer.per_part,
            "tokenizer": plan.name,
            "vocab_size": plan.vocab,
            "separator": plan.separator,
        }
        if plan.identity:
            build["tokenizer_identity"] = plan.identity
        if plan.vocab_from is not None:
            stats["vocab_size_from"] = plan.vocab_from
        for f in self.work.iterdir():
            if not f.name.startswith("shard-") or f.name not in {s.file for s in parts}:
                f.unlink()
        manifest = Manifest(self.seq_len, writer.dtype_name, tuple(parts), build, stats)
        return manifest.with_version_id()


def _chunked(
    items: Iterator[tuple[Item, dict[str, Any]]],
) -> Iterator[tuple[list[Item], dict[str, Any]]]:
    """Fixed chunks of documents: a function of the documents alone, never of the process
    count; each carries the state after its last document."""
    chunk: list[Item] = []
    size = 0
    tag: dict[str, Any] = {}
    for item, tag in items:
        chunk.append(item)
        size += len(item.payload)
        if size >= CHUNK_BYTES or len(chunk) >= CHUNK_DOCS:
            yield chunk, tag
            chunk, size = [], 0
    if chunk:
        yield chunk, tag


class _Spool:
    """Ids of a build whose vocabulary is not known up front, as uint32 in a temporary
    file inside the build directory (removed before the commit); it is its own journal for
    ``--resume``."""

    def __init__(self, path: Path, state: dict[str, Any] | None) -> None:
        self.path = path
        self.max_id, self.tokens_in = -1, 0
        if state is not None:
            self.max_id, self.tokens_in = int(state["max_id"]), int(state["tokens"])
            _truncate(path, self.tokens_in * 4)
        self.f = open(path, "ab")  # noqa: SIM115 (closed in replay or with the build dir)

    def add(self, ids: np.ndarray) -> None:
        if ids.size:
            self.max_id = max(self.max_id, int(ids.max()))
            self.f.write(ids.astype("<u4").tobytes())
            self.tokens_in += ids.size

    def checkpoint(self) -> None:
        self.f.flush()

    def saved(self) -> None:
        pass

    def state(self) -> dict[str, Any]:
        return {"max_id": self.max_id, "tokens": self.tokens_in}

    def replay(self, writer: _PartWriter) -> None:
        self.f.close()
        if self.path.stat().st_size:
            stream = np.memmap(self.path, dtype="<u4", mode="r")
            for start in range(0, stream.size, SPOOL_CHUNK):
                writer.add(np.asarray(stream[start : start + SPOOL_CHUNK]))
            del stream
        self.path.unlink()


def _truncate(path: Path, size: int) -> None:
    if not path.is_file() or path.stat().st_size < size:
        raise DataError(f"--resume: {path} is shorter than its state says ({size} bytes); "
                        "build again without --resume")  # fmt: skip
    with open(path, "r+b") as f:
        f.truncate(size)


class _PartWriter:
    """Accumulates tokens and writes full parts as raw little-endian row-major arrays.

    With ``journal``, the tokens not yet in a part are also in a *pending* file: each
    chunk's ids appended, rewritten under a new name when a part is cut, so ``state()``
    (parts written, pending file and length) is enough to resume."""

    def __init__(self, root: Path, dtype: str, row_tokens: int, part_mb: float,
                 state: dict[str, Any] | None, journal: bool = True) -> None:  # fmt: skip
        self.root, self.row, self.dtype_name = root, row_tokens, dtype
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.per_part = max(1, int(part_mb * MiB) // (row_tokens * self.dtype.itemsize))
        self.chunks: list[np.ndarray] = []
        self.pending = 0
        self.tokens_in = 0
        self.parts: list[PartInfo] = []
        self.journal = journal
        self.pending_file = "pending-0.bin"
        self._added: list[np.ndarray] = []
        self._cut = False
        self._stale: Path | None = None
        if state is not None:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        self.parts = [
            PartInfo(**s) for s in state.get("parts", state.get("shards", []))
        ]  # shards: older
        self.tokens_in, self.pending_file = int(state["tokens"]), state["pending_file"]
        n = int(state["pending"])
        path = self.root / self.pending_file
        _truncate(path, n * self.dtype.itemsize)
        rest = np.fromfile(path, dtype=self.dtype)
        self.chunks, self.pending = [rest], rest.size

    def add(self, ids: np.ndarray) -> None:
        ids = ids.astype(self.dtype, copy=False)
        self.chunks.append(ids)
        self._added.append(ids)
        self.pending += ids.size
        self.tokens_in += ids.size
        part_tokens = self.row * self.per_part
        if self.pending >= part_tokens:
            flat = np.concatenate(self.chunks)
            full = (flat.size // part_tokens) * part_tokens
            for start in range(0, full, part_tokens):
                self._write(flat[start : start + part_tokens])
            rest = flat[full:]
            self.chunks, self.pending = [rest], rest.size
            self._cut = True

    def checkpoint(self) -> None:
        """Put the pending tokens on disk (before the state that names them is saved)."""
        if not self.journal:
            return
        if self._cut:
            old = self.root / self.pending_file
            self.pending_file = f"pending-{len(self.parts)}.bin"
            rest = np.concatenate(self.chunks) if self.chunks else np.empty(0, self.dtype)
            (self.root / self.pending_file).write_bytes(rest.tobytes())
            if old.name != self.pending_file:
                self._stale = old  # removed once the state names the new file
        else:
            with open(self.root / self.pending_file, "ab") as f:
                for a in self._added:
                    f.write(a.tobytes())
        self._added, self._cut = [], False

    def saved(self) -> None:
        """The state naming the current pending file is on disk: drop the previous one."""
        if self._stale is not None:
            self._stale.unlink(missing_ok=True)
            self._stale = None

    def state(self) -> dict[str, Any]:
        return {"parts": [s.to_dict() for s in self.parts], "tokens": self.tokens_in,
                "pending_file": self.pending_file, "pending": self.pending}  # fmt: skip

    def finish(self) -> list[PartInfo]:
        flat = np.concatenate(self.chunks) if self.chunks else np.empty(0, self.dtype)
        usable = (flat.size // self.row) * self.row
        if usable:
            self._write(flat[:usable])
        if not self.parts:
            raise DataError(
                f"build: sources hold {self.tokens_in} tokens, fewer than one sample of "
                f"seq_len + 1 = {self.row} tokens"
            )
        return self.parts

    def _write(self, tokens: np.ndarray) -> None:
        data = np.ascontiguousarray(tokens, dtype=self.dtype).tobytes()
        name = f"shard-{len(self.parts):05d}.bin"
        write_file(self.root / name, data)
        self.parts.append(PartInfo(name, tokens.size // self.row, len(data), sha256_hex(data)))
