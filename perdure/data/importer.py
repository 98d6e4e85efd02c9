"""``import_arrays``: arrays (``.npy``, ``.npz``, raw token files) -> a versioned dataset.

Each field (``tokens``, and any others: ``labels``, ``loss_mask``, ``images``, ...) comes
from one or more files, read in the order given and concatenated. ``tokens`` is optional: a
dataset of images and labels has none, and its task receives its fields only.

- a **raw file** (any name not ending in ``.npy``: nanoGPT's ``train.bin``, a flat
  Megatron-style token stream) is a headerless little-endian array of the ``dtype`` given
  for it; its size must be a multiple of the dtype's item size;
- a **.npy** file carries its dtype and shape (no pickles are loaded);
- a **.npz** file (``numpy.savez``) gives the field its array of the field's name, or its
  only array; it is read into memory whole (numpy cannot memory-map one).

A 1-D source is a *stream*: the field's streams are concatenated and cut into consecutive,
non-overlapping samples of ``seq_len + 1`` values (the convention of ``perdure data build``:
a model reads ``tokens[:-1]`` and predicts ``tokens[1:]``), and the tail that does not fill
a sample is dropped (counted in the manifest's ``sources.dropped_tail``). A source of two or
more dimensions ``[n, *shape]`` holds ``n`` samples of that shape as they are. A 1-D field
other than tokens whose length is the tokens' sample count holds one value per sample
(shape ``[]``, e.g. a class label); a stream is at least 2 values a sample, so this cannot
be mistaken. Every field must yield the same number of samples, and every stream field the
same stream length (a loss mask one value short of its tokens is an error, not a silent
shift).

Without ``tokens`` the reference is the first field given whose source has two or more
dimensions: a 1-D field as long as its sample count holds one value per sample; with no such
field, every 1-D field holds one value per sample unless ``seq_len`` cuts it as a stream.

Token ids must be >= 0 and below ``vocab_size`` when given; otherwise the vocabulary is the
largest id + 1 (recorded as such in ``sources.vocab_size_from``). The tokens are stored in
the smallest dtype that holds the vocabulary, every other field in its source dtype. The
source files' dtypes are recorded in ``sources.inputs``. The output is written like a
build's: into a temporary directory, renamed into place, nothing left behind on failure.

Limits: all sources are memory-mapped and read twice (once for the token range, once to
write); a raw file must be little-endian; fields are not converted between dtypes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from perdure.data.errors import DataError
from perdure.data.fields import FIELD_DTYPES, TOKENS, Field, check_name, record_dtype
from perdure.data.hashing import sha256_hex
from perdure.data.manifest import Manifest, PartInfo
from perdure.data.output import commit, staged, write_file
from perdure.data.tokenize import dtype_for

MiB = 1 << 20
SCAN_CHUNK = 1 << 24
"""Values per chunk when scanning sources for their token range."""

PRETOKENIZED = "pretokenized"
"""``build.tokenizer`` of an import that names no tokenizer."""


@dataclass(frozen=True)
class _Source:
    path: Path
    array: np.ndarray
    """The whole file, memory-mapped, read-only."""

    @property
    def stream(self) -> bool:
        return self.array.ndim == 1


@dataclass
class _FieldIn:
    name: str
    sources: list[_Source]
    shape: tuple[int, ...]
    dtype: str
    samples: int
    stream_len: int | None
    """Values in the concatenated stream (stream fields), else None."""

    def rows(self, a: int, b: int) -> np.ndarray:
        """Samples ``[a, b)`` of this field, ``[b - a, *shape]``."""
        w = math.prod(self.shape)
        lo, hi, parts, start = a * w, b * w, [], 0
        for s in self.sources:
            flat = s.array.reshape(-1)
            end = start + flat.size
            if end > lo and start < hi:
                parts.append(flat[max(lo, start) - start : min(hi, end) - start])
            start = end
        return np.concatenate(parts).reshape((b - a, *self.shape))


def import_arrays(
    fields: dict[str, list[str]],
    out: str,
    *,
    seq_len: int | None = None,
    dtype: str | None = None,
    dtypes: dict[str, str] | None = None,
    vocab_size: int | None = None,
    tokenizer: str = PRETOKENIZED,
    part_mb: float = 64.0,
    overwrite: bool = False,
    note: dict[str, Any] | None = None,
    documents: np.ndarray | None = None,
) -> Manifest:
    """Import ``fields`` (name -> files; ``tokens`` optional) into a dataset at ``out``.

    ``seq_len``: stream fields are cut into samples of ``seq_len + 1`` values (needed when
    any source is 1-D). ``dtype``: the dtype of raw files; ``dtypes``: per-field overrides
    (``.npy`` files carry their own). ``tokenizer``: a name recorded as the tokens' meaning
    (e.g. ``gpt2``; it enters the version id). ``vocab_size``: the tokens' vocabulary
    (default: largest id + 1).
    """
    if not fields:
        raise DataError("import: no fields given (FILES for tokens, or --field NAME=PATH)")
    if TOKENS not in fields:
        return _import_fields(fields, out, seq_len=seq_len, dtype=dtype, dtypes=dtypes,
                              vocab_size=vocab_size, tokenizer=tokenizer, part_mb=part_mb,
                              overwrite=overwrite, note=note, documents=documents)  # fmt: skip
    if seq_len is not None and seq_len < 1:
        raise DataError(f"import: --seq-len must be >= 1 (got {seq_len})")
    if not part_mb > 0:
        raise DataError(f"import: --part-mb must be > 0 (got {part_mb})")
    if vocab_size is not None and not 1 <= vocab_size <= 2**32:
        raise DataError(f"import: --vocab-size must be in [1, 2**32] (got {vocab_size})")
    if not tokenizer:
        raise DataError("import: --tokenizer-name must not be empty")
    order = [TOKENS, *(n for n in fields if n != TOKENS)]
    raw = dtypes or {}
    ins = [_field_in(TOKENS, _open_all(TOKENS, fields[TOKENS], raw.get(TOKENS, dtype)),
                     seq_len, None)]  # fmt: skip
    ins += [_field_in(n, _open_all(n, fields[n], raw.get(n, dtype)), seq_len, ins[0])
            for n in order[1:]]  # fmt: skip
    _check_lengths(ins)
    tokens = ins[0]
    lo, hi = _token_range(tokens)
    if lo < 0:
        raise DataError(f"import: token ids must be >= 0 (got {lo} in {_names(tokens)})")
    if hi >= 2**32:
        raise DataError(f"import: token ids must be below 2**32 (got {hi} in {_names(tokens)})")
    vocab = vocab_size if vocab_size is not None else hi + 1
    if hi >= vocab:
        raise DataError(
            f"import: token ids must be below --vocab-size {vocab} (got {hi} in {_names(tokens)})"
        )
    layout = (
        Field(TOKENS, dtype_for(vocab), tokens.shape),
        *(Field(f.name, f.dtype, f.shape) for f in ins[1:]),
    )
    with staged(out, overwrite, "import") as tmp:
        per_part, parts = _write_parts(tmp, ins, layout, part_mb)
        build: dict[str, Any] = {
            "seq_len": tokens.shape[0] - 1,
            "samples_per_shard": per_part,
            "tokenizer": tokenizer,
            "vocab_size": vocab,
        }
        if documents is not None:
            build["documents"] = _write_documents(tmp, documents, tokens.samples * tokens.shape[0])
        m = Manifest(
            tokens.shape[0] - 1,
            layout[0].dtype,
            tuple(parts),
            build,
            {**_sources(ins, vocab_size), **(note or {})},
            "",
            layout[1:],
        ).with_version_id()
        commit(tmp, out, m)
    return m


def _import_fields(
    fields: dict[str, list[str]],
    out: str,
    *,
    seq_len: int | None,
    dtype: str | None,
    dtypes: dict[str, str] | None,
    vocab_size: int | None,
    tokenizer: str,
    part_mb: float,
    overwrite: bool,
    note: dict[str, Any] | None,
    documents: np.ndarray | None,
) -> Manifest:
    """A dataset without ``tokens`` (e.g. images and labels): every field as given, the
    first of two or more dimensions the reference for the per-sample 1-D fields."""
    if vocab_size is not None or tokenizer != PRETOKENIZED or documents is not None:
        raise DataError(
            "import: --vocab-size, --tokenizer-name and document boundaries describe "
            f"tokens; the fields {list(fields)} hold no {TOKENS!r}"
        )
    if seq_len is not None and seq_len < 1:
        raise DataError(f"import: --seq-len must be >= 1 (got {seq_len})")
    if not part_mb > 0:
        raise DataError(f"import: --part-mb must be > 0 (got {part_mb})")
    raw = dtypes or {}
    srcs = {n: _open_all(n, files, raw.get(n, dtype)) for n, files in fields.items()}
    first = next((n for n, ss in srcs.items() if ss[0].array.ndim >= 2), None)
    order = [first] if first is not None else []
    order += [n for n in fields if n != first]
    ins: list[_FieldIn] = []
    for n in order:
        ref = ins[0] if ins else None
        ins.append(_field_in(n, srcs[n], seq_len, ref, scalars=ref is None and seq_len is None))
    _check_lengths(ins)
    layout = tuple(Field(f.name, f.dtype, f.shape) for f in ins)
    with staged(out, overwrite, "import") as tmp:
        per_part, parts = _write_parts(tmp, ins, layout, part_mb)
        sources = {**_sources(ins, None), **(note or {})}
        sources.pop("vocab_size_from")
        m = Manifest(0, "", tuple(parts), {"samples_per_shard": per_part}, sources, "",
                     layout, tokens=False).with_version_id()  # fmt: skip
        commit(tmp, out, m)
    return m


def _open_all(name: str, files: list[str], raw: str | None) -> list[_Source]:
    """A field's sources, checked to agree in dtype and sample shape."""
    check_name(name, "import")
    if not files:
        raise DataError(f"import: field {name!r} has no files")
    srcs = [_open(Path(f), raw, name) for f in files]
    first = srcs[0]
    for s in srcs[1:]:
        if s.array.dtype != first.array.dtype or s.array.shape[1:] != first.array.shape[1:]:
            raise DataError(
                f"import: the files of field {name!r} must agree in dtype and sample "
                f"shape: {first.path} is {_desc(first)}, {s.path} is {_desc(s)}"
            )
    return srcs


def _field_in(
    name: str,
    srcs: list[_Source],
    seq_len: int | None,
    tokens: _FieldIn | None,
    *,
    scalars: bool = False,
) -> _FieldIn:
    """One field's sources, checked; ``tokens``: the reference field, the tokens where there
    are some (None for itself). ``scalars``: a 1-D source holds one value per sample."""
    first = srcs[0]
    kind = first.array.dtype
    if name == TOKENS and not np.issubdtype(kind, np.integer):
        raise DataError(f"{first.path}: token ids must be integers (got dtype {kind})")
    total = sum(s.array.size for s in srcs)
    if first.stream and (scalars or (tokens is not None and total == tokens.samples)):
        return _FieldIn(name, srcs, (), _stored(kind), total, None)  # one value per sample
    if first.stream and seq_len is None and tokens is not None and tokens.name != TOKENS:
        raise DataError(
            f"import: field {name!r} has {total} values, {tokens.name!r} "
            f"{tokens.samples} samples: a 1-D field holds one value per sample (or pass "
            "--seq-len to cut it as a stream)"
        )
    if first.stream:
        if seq_len is None:
            raise DataError(
                f"import: --seq-len is needed to cut the 1-D stream {first.path} "
                f"(field {name!r}) into samples"
            )
        shape: tuple[int, ...] = (seq_len + 1,)
        samples, stream_len = total // (seq_len + 1), total
    else:
        shape = tuple(int(d) for d in first.array.shape[1:])
        samples, stream_len = sum(int(s.array.shape[0]) for s in srcs), None
    if name == TOKENS and len(shape) != 1:
        raise DataError(
            f"{first.path}: tokens must be a 1-D stream or [samples, seq_len + 1] "
            f"(got shape {list(first.array.shape)})"
        )
    if name == TOKENS and not first.stream and seq_len is not None and shape[0] != seq_len + 1:
        raise DataError(
            f"{first.path}: samples of {shape[0]} tokens, but --seq-len {seq_len} "
            f"means {seq_len + 1}"
        )
    if name == TOKENS and shape[0] < 2:
        raise DataError(f"{first.path}: samples must hold at least 2 tokens (got {shape[0]})")
    if 0 in shape:
        raise DataError(f"{first.path}: a sample's shape must not be empty (got {list(shape)})")
    return _FieldIn(name, srcs, shape, _stored(kind), samples, stream_len)


def _open(path: Path, raw: str | None, name: str) -> _Source:
    if not path.is_file():
        raise DataError(f"{path}: no such file (field {name!r})")
    if path.suffix in (".npy", ".npz"):
        arr = _load_npy(path, name)
        if arr.dtype.kind == "b":
            arr = arr.view(np.uint8)
        if arr.ndim == 0:
            raise DataError(
                f"{path}: a .npy source must have at least one dimension (got a scalar)"
            )
        if arr.dtype.str.lstrip("<>|=") not in {np.dtype(d).str[1:] for d in FIELD_DTYPES}:
            raise DataError(f"{path}: dtype must be one of {list(FIELD_DTYPES)} (got {arr.dtype})")
        return _Source(path, arr)
    if raw is None:
        raise DataError(
            f"{path}: a raw file needs its dtype (--dtype, e.g. uint16 for "
            f"nanoGPT's train.bin; field {name!r})"
        )
    if raw not in FIELD_DTYPES:
        raise DataError(f"--dtype: must be one of {list(FIELD_DTYPES)} (got {raw!r}, for {path})")
    dt = np.dtype(raw).newbyteorder("<")
    size = path.stat().st_size
    if size % dt.itemsize:
        raise DataError(
            f"{path}: size {size} bytes is not a multiple of {dt.itemsize} bytes, "
            f"the item size of {raw} (wrong --dtype, or a truncated file?)"
        )
    if size == 0:
        return _Source(path, np.empty(0, dtype=dt))
    return _Source(path, np.memmap(path, dtype=dt, mode="r"))


def _load_npy(path: Path, name: str) -> np.ndarray:
    """A .npy memory-mapped, or a .npz's array named like the field (or its only one)."""
    try:
        if path.suffix == ".npy":
            return np.load(path, mmap_mode="r", allow_pickle=False)
        with np.load(path, allow_pickle=False) as z:
            keys = list(z.files)
            key = name if name in keys else keys[0] if len(keys) == 1 else None
            if key is None:
                raise DataError(
                    f"{path}: holds no array {name!r} (it has {keys}; field {name!r} takes "
                    "the array of its name or a file's only one)"
                )
            return z[key]
    except (ValueError, OSError, EOFError) as e:
        raise DataError(f"{path}: not a readable {path.suffix} file ({e})") from None


def _stored(dt: np.dtype) -> str:
    return np.dtype(dt).newbyteorder("=").name


def _desc(s: _Source) -> str:
    return f"{s.array.dtype.name} {list(s.array.shape)}"


def _names(f: _FieldIn) -> str:
    return ", ".join(str(s.path) for s in f.sources)


def _check_lengths(ins: list[_FieldIn]) -> None:
    """Every field as many samples as the first (the tokens, or the reference field)."""
    ref = ins[0]
    for f in ins[1:]:
        streams = ref.stream_len is not None and f.stream_len is not None
        if streams and f.stream_len != ref.stream_len:
            raise DataError(
                f"import: field {f.name!r} has {f.stream_len} values in its "
                f"stream, {ref.name!r} {ref.stream_len}: streams must be "
                "equally long"
            )
        if f.samples != ref.samples:
            raise DataError(
                f"import: field {f.name!r} has {f.samples} samples, {ref.name!r} "
                f"{ref.samples}: every field needs one value per sample"
            )
    if ref.samples == 0:
        what = f"{ref.shape[0]} tokens" if ref.name == TOKENS else f"field {ref.name!r}"
        raise DataError(f"import: {_names(ref)} hold fewer than one sample of {what}")


def _token_range(tokens: _FieldIn) -> tuple[int, int]:
    lo, hi = 0, -1
    used = tokens.samples * tokens.shape[0]
    start = 0
    for s in tokens.sources:
        flat = s.array.reshape(-1)[: max(0, used - start)]
        for a in range(0, flat.size, SCAN_CHUNK):
            chunk = flat[a : a + SCAN_CHUNK]
            lo, hi = min(lo, int(chunk.min())), max(hi, int(chunk.max()))
        start += s.array.size
    return lo, hi


def _write_parts(
    tmp: Path, ins: list[_FieldIn], layout: tuple[Field, ...], part_mb: float
) -> tuple[int, list[PartInfo]]:
    rec = record_dtype(layout)
    per_part = max(1, int(part_mb * MiB) // rec.itemsize)
    n = ins[0].samples
    parts = []
    for k, a in enumerate(range(0, n, per_part)):
        b = min(n, a + per_part)
        records = np.empty(b - a, dtype=rec)
        for f in ins:
            records[f.name] = f.rows(a, b)
        data = records.tobytes()
        name = f"shard-{k:05d}.bin"
        write_file(tmp / name, data)
        parts.append(PartInfo(name, b - a, len(data), sha256_hex(data)))
    return per_part, parts


def _sources(ins: list[_FieldIn], vocab_size: int | None) -> dict[str, Any]:
    """Informational (not in the version id): what was read, and what was dropped."""
    inputs = [
        {
            "field": f.name,
            "file": s.path.name,
            "dtype": _stored(s.array.dtype),
            "shape": list(s.array.shape),
        }
        for f in ins
        for s in f.sources
    ]
    dropped = {
        f.name: f.stream_len - f.samples * math.prod(f.shape)
        for f in ins
        if f.stream_len is not None
    }
    out: dict[str, Any] = {
        "files": len(inputs),
        "bytes": sum(int(s.array.nbytes) for f in ins for s in f.sources),
        "inputs": inputs,
        "vocab_size_from": "--vocab-size" if vocab_size is not None else "max_id",
    }
    if dropped:
        out["dropped_tail"] = dropped
    return out


DOCUMENTS = "documents.bin"


def _write_documents(tmp: Path, starts: np.ndarray, used: int) -> dict[str, Any]:
    """Document starts (token offsets into the dataset's stream of samples, int64
    little-endian) in ``documents.bin``; its entry in the build parameters names the file,
    the count and the SHA-256, so the boundaries are part of the version id."""
    kept = np.unique(np.asarray(starts, dtype=np.int64))
    kept = kept[(kept >= 0) & (kept < used)].astype("<i8")
    data = kept.tobytes()
    write_file(tmp / DOCUMENTS, data)
    return {"file": DOCUMENTS, "count": int(kept.size), "sha256": sha256_hex(data)}
