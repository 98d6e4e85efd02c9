"""Text records in: one document per record of JSON Lines, Parquet or a ``datasets`` directory.

``perdure data build SOURCES --text-field NAME`` reads, for each source in the order of
:func:`list_record_sources` (sources in the order given; inside a directory, files sorted
by their POSIX path relative to it), the records in file order, and takes the string field
``NAME`` of each as one document:

- ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` (also ``.json.gz``/``.ndjson`` spellings): one
  JSON object a line, blank lines ignored; read line by line from the (decompressed)
  stream;
- ``.parquet``: the one column, read row group by row group with ``pyarrow`` (never the
  whole file);
- a directory written by ``datasets.Dataset.save_to_disk`` (it holds ``state.json`` and
  ``dataset_info.json``): opened with ``datasets.load_from_disk``, locally (the library is
  put offline first: nothing is ever fetched from a hub), read in batches.

The same records in any of these containers yield the same documents in the same order,
so the same tokens, parts and version id: the container is not part of the data.

A record whose field is missing, null or not a string is an error naming the file, the
row (0-based, counting records; for JSON Lines also the line) and the field; with
``skip_bad`` it is skipped and counted instead (:class:`Skipped`, recorded in the
manifest's ``sources.skipped_records``). A line that is not JSON is such a bad record too.

Limits: a ``DatasetDict`` directory (several splits) is refused: name one split's
directory. ``datasets`` and ``pyarrow`` are imported only when a source needs them.
"""

from __future__ import annotations

import gzip
import io
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from perdure.data.errors import DataError

JSONL_SUFFIXES = (".jsonl", ".ndjson", ".jsonl.gz", ".ndjson.gz", ".jsonl.zst", ".ndjson.zst")
PARQUET_SUFFIXES = (".parquet",)
RECORD_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES
BATCH_ROWS = 4096
"""Rows per batch read from Parquet and ``datasets`` (bounds memory, not the result)."""
KEEP_SKIPPED = 20
"""How many skipped records the manifest names (all of them are counted)."""


@dataclass(frozen=True)
class Doc:
    """One document: its text, where it came from, and how far its source has been read."""

    text: str
    source: str
    row: int
    done: float
    """Bytes of the sources read so far (an estimate inside a compressed or columnar file),
    for progress and ETA only."""
    seq: int
    """Records consumed so far, this one and bad ones included (what ``--resume`` skips)."""


@dataclass
class Skipped:
    """Bad records skipped under ``--skip-bad-records``: all counted, the first few named."""

    count: int = 0
    first: list[dict[str, Any]] = field(default_factory=list)

    def add(self, source: str, row: int, reason: str) -> None:
        self.count += 1
        if len(self.first) < KEEP_SKIPPED:
            self.first.append({"file": source, "row": row, "reason": reason})

    def to_dict(self) -> dict[str, Any]:
        return {"count": self.count, "first": list(self.first)}


def is_dataset_dir(path: Path) -> bool:
    return (path / "state.json").is_file() and (path / "dataset_info.json").is_file()


def is_record_file(path: Path) -> bool:
    return path.name.endswith(RECORD_SUFFIXES)


def list_record_sources(sources: list[str]) -> list[Path]:
    """Record files and ``datasets`` directories of ``sources``: a source that is neither
    (nor a directory holding some) is an error naming it."""
    if not sources:
        raise DataError("build: sources must not be empty (got [])")
    out: list[Path] = []
    seen: set[Path] = set()
    for src in sources:
        for p in _expand(Path(src), src):
            if p.resolve() not in seen:
                seen.add(p.resolve())
                out.append(p)
    return out


def _expand(path: Path, src: str) -> list[Path]:
    if path.is_file():
        if not is_record_file(path):
            raise DataError(
                f"{src}: --text-field reads {', '.join(RECORD_SUFFIXES)} files or a "
                "`datasets` save_to_disk directory (got a file of another kind)"
            )
        return [path]
    if not path.is_dir():
        raise DataError(f"build: source {src!r} matches no file")
    if is_dataset_dir(path):
        return [path]
    if (path / "dataset_dict.json").is_file():
        raise DataError(
            f"{src}: a DatasetDict (several splits); name one split's directory, e.g. {src}/train"
        )
    found: list[tuple[str, Path]] = []
    for dirpath, dirs, names in os.walk(path):
        here = Path(dirpath)
        for d in list(dirs):
            if is_dataset_dir(here / d):
                found.append(((here / d).relative_to(path).as_posix(), here / d))
                dirs.remove(d)
        found += [((here / n).relative_to(path).as_posix(), here / n) for n in names
                  if is_record_file(here / n)]  # fmt: skip
    if not found:
        raise DataError(f"build: source {src!r} holds no {', '.join(RECORD_SUFFIXES)} file")
    return [p for _, p in sorted(found)]


def iter_docs(
    paths: list[Path], text_field: str, skipped: Skipped | None, skip: int = 0
) -> Iterator[Doc]:
    """Every record's text as a :class:`Doc`, sources in order, rows in file order.
    ``skipped``: count bad records there instead of raising (``--skip-bad-records``).
    ``skip``: pass over the first ``skip`` records (good or bad) silently (``--resume``)."""
    done, seq = 0.0, 0
    for p in paths:
        size = float(_size(p))
        if p.is_dir():
            it = _dataset_texts(p, text_field)
        elif p.name.endswith(PARQUET_SUFFIXES):
            it = _parquet_texts(p, text_field)
        else:
            it = _jsonl_texts(p, text_field)
        for row, value, frac in it:
            seq += 1
            if seq <= skip:
                continue
            if isinstance(value, str):
                yield Doc(value, str(p), row, done + frac * size, seq)
                continue
            reason = value if isinstance(value, _Bad) else _Bad(_what(value))
            message = f"{p}: row {row}{reason.where}: field {text_field!r} {reason.text}"
            if skipped is None:
                raise DataError(message + " (pass --skip-bad-records to skip such records)")
            skipped.add(str(p), row, f"field {text_field!r} {reason.text}")
        done += size


@dataclass(frozen=True)
class _Bad:
    text: str
    where: str = ""


def _what(value: object) -> str:
    if value is None:
        return "is null, not a string"
    return f"is {type(value).__name__}, not a string"


def _size(p: Path) -> int:
    if p.is_file():
        return p.stat().st_size
    return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())


def _open_jsonl(p: Path) -> tuple[Any, Any]:
    """(line reader, raw file whose tell() measures progress)."""
    raw = open(p, "rb")  # noqa: SIM115 (closed by the caller)
    if p.name.endswith(".gz"):
        return io.BufferedReader(gzip.GzipFile(fileobj=raw)), raw
    if p.name.endswith(".zst"):
        try:
            import zstandard
        except ImportError:
            raw.close()
            raise DataError(f"{p}: .zst needs the `zstandard` package "
                            "(pip install perdure[records])") from None  # fmt: skip
        reader = zstandard.ZstdDecompressor().stream_reader(raw, read_across_frames=True)
        return io.BufferedReader(reader), raw  # type: ignore[arg-type]
    return raw, raw


def _jsonl_texts(p: Path, name: str) -> Iterator[tuple[int, object, float]]:
    size = max(1, p.stat().st_size)
    lines, raw = _open_jsonl(p)
    row = 0
    try:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                yield (
                    row,
                    _Bad(f"cannot be read: the line is not JSON ({e})", f" (line {lineno})"),
                    0,
                )
                row += 1
                continue
            if not isinstance(rec, dict):
                kind = type(rec).__name__
                value: object = _Bad(f"cannot be read: the record is a JSON {kind}, "
                                     "not an object", f" (line {lineno})")  # fmt: skip
            elif name not in rec:
                value = _Bad("is missing", f" (line {lineno})")
            elif not isinstance(rec[name], str):
                value = _Bad(_what(rec[name]), f" (line {lineno})")
            else:
                value = rec[name]
            yield row, value, raw.tell() / size
            row += 1
    except (OSError, EOFError) as e:
        raise DataError(f"{p}: cannot be read after row {row} ({type(e).__name__}: {e})") from None
    finally:
        lines.close()
        raw.close()


def _parquet_texts(p: Path, name: str) -> Iterator[tuple[int, object, float]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{p}: .parquet needs the `pyarrow` package "
                        "(pip install perdure[records])") from None  # fmt: skip
    try:
        f = pq.ParquetFile(p)
    except Exception as e:  # pyarrow raises its own ArrowInvalid, OSError, ...
        raise DataError(f"{p}: not a readable Parquet file ({e})") from None
    with f:
        if name not in f.schema_arrow.names:
            yield 0, _Bad(f"is missing (the file's columns: {f.schema_arrow.names})"), 0.0
            return
        total = max(1, f.metadata.num_rows)
        yield from _arrow_batches(f.iter_batches(batch_size=BATCH_ROWS, columns=[name]), name,
                                  total)  # fmt: skip


def _arrow_batches(batches: Any, name: str, total: int) -> Iterator[tuple[int, object, float]]:
    import pyarrow as pa

    row = 0
    for batch in batches:
        col = batch.column(name) if hasattr(batch, "column") else batch[name]
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)
                or pa.types.is_string_view(col.type)):  # fmt: skip
            yield row, _Bad(f"is {col.type}, not a string"), row / total
            return
        values = col.to_pylist()
        for v in values:
            yield row, v, row / total
            row += 1


def _dataset_texts(p: Path, name: str) -> Iterator[tuple[int, object, float]]:
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # load_from_disk reads locally anyway
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import datasets
    except ImportError:
        raise DataError(f"{p}: a save_to_disk directory needs the `datasets` package "
                        "(pip install perdure[records])") from None  # fmt: skip
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:
        raise DataError(f"{p}: not a `datasets` directory load_from_disk can read ({e})") from None
    if not isinstance(ds, datasets.Dataset):
        raise DataError(f"{p}: a {type(ds).__name__}; name one split's directory")
    if name not in ds.column_names:
        yield 0, _Bad(f"is missing (the dataset's columns: {ds.column_names})"), 0.0
        return
    arrow = ds.select_columns([name]).with_format("arrow")
    yield from _arrow_batches(arrow.iter(batch_size=BATCH_ROWS), name, max(1, len(ds)))
