"""``manifest.json``: what a dataset holds, how to read it, and its content address.

The manifest is the only metadata of a dataset. Parts are raw little-endian arrays of
shape ``[samples, seq_len + 1]`` whose dtype is in ``sample.dtype`` (format version 1, a
tokens-only dataset), or of ``samples`` packed records of the named fields listed in
``sample.fields`` (format version 2: ``tokens`` first, then e.g. ``labels``,
``loss_mask``), or of named fields without ``tokens`` at all (format version 2 too:
images and labels; ``seq_len`` is then null); the manifest gives each part's sample count,
byte size and SHA-256. A tokens-only dataset is always written as version 1, so its
manifest and version id are what they were before fields existed. The *version id* is a
SHA-256 over the part checksums and the build parameters that give the tokens their
meaning (see :func:`version_id`), so any change of content or meaning changes it, and two
builds of the same content agree on it on any machine. Schema: ``docs/data.md``.

Parts were called shards until the word was kept for optimizer and parameter shards: a
manifest lists them under ``parts`` and an older one under ``shards`` (both read). The names
that enter the version id kept the old word (the files ``shard-NNNNN.bin``, the build keys
``part_mb`` and ``samples_per_shard``, the id's own ``shards`` key), so no id changed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perdure.data.errors import DataError, Problems
from perdure.data.fields import (
    FIELD_DTYPES,
    RESERVED,
    TOKEN_DTYPES,
    TOKENS,
    Field,
    record_dtype,
    valid_name,
)
from perdure.data.hashing import canonical_hash

FORMAT = "perdure-dataset"
FORMAT_VERSION = 1
"""The version of a tokens-only dataset (one row of tokens per sample)."""
FIELDS_FORMAT_VERSION = 2
"""The version of a dataset with fields besides ``tokens``."""
IN_PLACE_FORMAT_VERSION = 3
"""The version of a tokens-only dataset whose parts reference files where they lie
(``perdure data import --in-place``): version 1's layout plus each part's ``source``."""
MANIFEST_NAME = "manifest.json"
PARTS_KEY = "parts"
"""The manifest's list of part files."""
OLD_PARTS_KEY = "shards"
"""The same list in a manifest written before parts were called parts (read, never written;
still the key the version id hashes the list under, so that no id changed)."""
DTYPES = TOKEN_DTYPES
"""Allowed token dtypes, always stored little-endian."""


@dataclass(frozen=True)
class PartInfo:
    """One part file: name relative to the dataset root, rows, bytes and SHA-256 (hex)."""

    file: str
    samples: int
    bytes: int
    sha256: str
    source: SourceRef | None = None
    """An in-place part (format version 3): the rows are bytes ``[offset, offset + bytes)``
    of a file outside the dataset directory, and ``sha256`` is that whole file's."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"file": self.file, "samples": self.samples, "bytes": self.bytes,
                               "sha256": self.sha256}  # fmt: skip
        if self.source is not None:
            out["source"] = self.source.to_dict()
        return out

    def id_entry(self) -> list[Any]:
        """What the version id hashes of this part (not where its source lies)."""
        entry: list[Any] = [self.file, self.samples, self.bytes, self.sha256]
        if self.source is not None:
            entry += [self.source.offset, self.source.size]
        return entry


@dataclass(frozen=True)
class SourceRef:
    """Where an in-place part's bytes lie: a local path or an fsspec URL, the byte offset
    of its first row, and the file's whole size (checked before every read)."""

    url: str
    offset: int
    size: int

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "offset": self.offset, "size": self.size}


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest. ``build`` holds the parameters that enter the id."""

    seq_len: int
    dtype: str
    parts: tuple[PartInfo, ...]
    build: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, Any] = field(default_factory=dict)
    """Informational (file count, bytes read); not part of the version id, since the same
    content read from other paths is the same dataset."""
    version_id: str = ""
    extra_fields: tuple[Field, ...] = ()
    """The fields besides ``tokens``, in record order (empty: format version 1)."""
    tokens: bool = True
    """Whether samples hold a ``tokens`` field. False: a dataset of other arrays only (e.g.
    images and labels), whose ``seq_len`` is 0 (null in the JSON) and ``dtype`` empty."""

    @property
    def sample_shape(self) -> tuple[int]:
        """Shape of the tokens field of one sample."""
        return (self.seq_len + 1,)

    @property
    def fields(self) -> tuple[Field, ...]:
        """Every field of a sample, in record order: ``tokens`` first where there is one."""
        if not self.tokens:
            return self.extra_fields
        return (Field(TOKENS, self.dtype, self.sample_shape), *self.extra_fields)

    @property
    def structured(self) -> bool:
        """Samples are packed records of named fields (format version 2), not token rows."""
        return bool(self.extra_fields) or not self.tokens

    @property
    def in_place(self) -> bool:
        return any(s.source is not None for s in self.parts)

    @property
    def format_version(self) -> int:
        if self.in_place:
            return IN_PLACE_FORMAT_VERSION
        return FIELDS_FORMAT_VERSION if self.structured else FORMAT_VERSION

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample (all its fields)."""
        return sum(f.nbytes for f in self.fields)

    def record_dtype(self) -> np.dtype:
        """One sample as a packed structured dtype (every field, in order)."""
        return record_dtype(self.fields)

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.parts)

    @property
    def num_tokens(self) -> int:
        return self.num_samples * (self.seq_len + 1) if self.tokens else 0

    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("<")

    def with_version_id(self) -> Manifest:
        return Manifest(self.seq_len, self.dtype, self.parts, self.build, self.sources,
                        version_id(self), self.extra_fields, self.tokens)  # fmt: skip

    def sample_dict(self) -> dict[str, Any]:
        if not self.structured:
            return {"dtype": self.dtype, "byte_order": "little", "shape": [self.seq_len + 1]}
        return {"byte_order": "little", "fields": [f.to_dict() for f in self.fields],
                "row_bytes": self.row_bytes}  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": self.format_version,
            "version_id": self.version_id,
            "sample": self.sample_dict(),
            "seq_len": self.seq_len if self.tokens else None,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "build": self.build,
            "sources": self.sources,
            PARTS_KEY: [s.to_dict() for s in self.parts],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def version_id(m: Manifest) -> str:
    """``sha256:<hex>`` over the format version, sample layout (every field's name, dtype
    and shape), build parameters and every part's (file, samples, bytes, sha256), in
    part order. Version 1 hashes exactly what it always has."""
    if m.structured:
        sample: dict[str, Any] = {"fields": [[f.name, f.dtype, list(f.shape)] for f in m.fields]}
    else:
        sample = {"dtype": m.dtype, "shape": [m.seq_len + 1]}
    return canonical_hash({
        "format_version": m.format_version,
        "sample": sample,
        "build": m.build,
        "shards": [s.id_entry() for s in m.parts],  # the key of old: ids must not change
    })  # fmt: skip


def parse_manifest(text: str, source: str) -> Manifest:
    """Parse and validate ``manifest.json`` text; every problem names ``source`` and field."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{source}: not valid JSON ({e})") from None
    p = Problems(source)
    if not p.check(isinstance(data, dict), "<root>", "must be a JSON object", type(data).__name__):
        p.done()
    p.check(data.get("format") == FORMAT, "format", f"must be {FORMAT!r}", data.get("format"))
    fv = data.get("format_version")
    known = (FORMAT_VERSION, FIELDS_FORMAT_VERSION, IN_PLACE_FORMAT_VERSION)
    p.check(fv in known, "format_version", f"must be one of {list(known)}", fv)
    if fv == FIELDS_FORMAT_VERSION:
        seq_len, dtype, extra, tokens = _sample_fields(data, p)
    else:
        (seq_len, dtype), extra, tokens = _sample(data, p), (), True
    row = Manifest(seq_len, dtype, (), extra_fields=extra, tokens=tokens).row_bytes
    parts = _parts(_parts_list(data, p), row, p)
    in_place = [s.source is not None for s in parts]
    if fv == IN_PLACE_FORMAT_VERSION:
        p.check(all(in_place), "parts", "every part of format version 3 needs a source", "")
    else:
        p.check(not any(in_place), "parts", "a source needs format_version 3", fv)
    build, sources = data.get("build", {}), data.get("sources", {})
    p.check(isinstance(build, dict), "build", "must be an object", build)
    p.check(isinstance(sources, dict), "sources", "must be an object", sources)
    p.done()
    m = Manifest(seq_len, dtype, tuple(parts), build, sources, "", extra, tokens)
    m = m.with_version_id()
    vid = data.get("version_id")
    p.check(vid == m.version_id, "version_id", f"does not match the content ({m.version_id})", vid)
    n = data.get("num_samples")
    p.check(n == m.num_samples, "num_samples", f"must equal the parts' sum {m.num_samples}", n)
    p.done()
    return m


def _parts_list(data: dict[str, Any], p: Problems) -> object:
    """The ``parts`` list, or ``shards`` in a manifest written before the rename (the
    layout is the same, so the format version is too); never both."""
    if OLD_PARTS_KEY not in data:
        return data.get(PARTS_KEY)
    p.check(PARTS_KEY not in data, OLD_PARTS_KEY, f"cannot be given with {PARTS_KEY!r} (the "
            "same list under its old name)", "both")  # fmt: skip
    return data[OLD_PARTS_KEY]


def _sample(data: dict[str, Any], p: Problems) -> tuple[int, str]:
    seq_len: Any = data.get("seq_len")
    ok = isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 1
    p.check(ok, "seq_len", "must be an integer >= 1", seq_len)
    sample: Any = data.get("sample")
    if not p.check(isinstance(sample, dict), "sample", "must be an object", sample):
        return 1, "uint8"
    dtype = sample.get("dtype")
    p.check(dtype in DTYPES, "sample.dtype", f"must be one of {list(DTYPES)}", dtype)
    order = sample.get("byte_order")
    p.check(order == "little", "sample.byte_order", "must be 'little'", order)
    if ok:
        shape = sample.get("shape")
        p.check(shape == [seq_len + 1], "sample.shape", f"must be [seq_len + 1] = [{seq_len + 1}]",
                shape)  # fmt: skip
    return (seq_len if ok else 1), (dtype if dtype in DTYPES else "uint8")


def _sample_fields(data: dict[str, Any], p: Problems) -> tuple[int, str, tuple[Field, ...], bool]:
    """Version 2: ``sample.fields``, tokens first (seq_len is the tokens' length - 1), or no
    tokens field at all (seq_len null)."""
    sample: Any = data.get("sample")
    if not p.check(isinstance(sample, dict), "sample", "must be an object", sample):
        return 1, "uint8", (), True
    order = sample.get("byte_order")
    p.check(order == "little", "sample.byte_order", "must be 'little'", order)
    raw: Any = sample.get("fields")
    if not p.check(isinstance(raw, list) and len(raw) >= 1, "sample.fields",
                   "must be a non-empty list of fields", raw):  # fmt: skip
        return 1, "uint8", (), True
    fields = [_field(f, i, p) for i, f in enumerate(raw)]
    names = [f.name for f in fields if f is not None]
    p.check(len(set(names)) == len(names), "sample.fields", "field names must be unique", names)
    p.check(
        TOKENS not in names[1:],
        "sample.fields[0].name",
        f"must be {TOKENS!r} where a {TOKENS!r} field is listed",
        names[0] if names else None,
    )
    row = sample.get("row_bytes")
    want = sum(f.nbytes for f in fields if f is not None)
    p.check(row == want, "sample.row_bytes", f"must equal the fields' bytes {want}", row)
    if not isinstance(raw[0], dict) or raw[0].get("name") != TOKENS:
        seq: Any = data.get("seq_len")
        p.check(seq is None, "seq_len", f"must be null without a {TOKENS!r} field", seq)
        return 0, "", tuple(f for f in fields if f is not None), False
    seq_len: Any = data.get("seq_len")
    ok = isinstance(seq_len, int) and not isinstance(seq_len, bool) and seq_len >= 1
    p.check(ok, "seq_len", "must be an integer >= 1", seq_len)
    p.check(len(raw) >= 2, "sample.fields", "must list another field beside tokens (a "
            "tokens-only dataset is format version 1)", names)  # fmt: skip
    tokens = fields[0]
    if tokens is not None:
        p.check(tokens.dtype in TOKEN_DTYPES, "sample.fields[0].dtype",
                f"must be one of {list(TOKEN_DTYPES)}", tokens.dtype)  # fmt: skip
        if ok:
            p.check(tokens.shape == (seq_len + 1,), "sample.fields[0].shape",
                    f"must be [seq_len + 1] = [{seq_len + 1}]", list(tokens.shape))  # fmt: skip
    extra = tuple(f for f in fields[1:] if f is not None)
    dtype = tokens.dtype if tokens is not None and tokens.dtype in TOKEN_DTYPES else "uint8"
    return (seq_len if ok else 1), dtype, extra, True


def _field(raw: object, i: int, p: Problems) -> Field | None:
    key = f"sample.fields[{i}]"
    if not p.check(isinstance(raw, dict), key, "must be an object", raw):
        return None
    assert isinstance(raw, dict)
    name, dtype, shape = raw.get("name"), raw.get("dtype"), raw.get("shape")
    ok = p.check(valid_name(name), f"{key}.name",
                 f"must be a lower-case identifier, not one of {list(RESERVED)}", name)  # fmt: skip
    ok &= p.check(dtype in FIELD_DTYPES, f"{key}.dtype", f"must be one of {list(FIELD_DTYPES)}",
                  dtype)  # fmt: skip
    ok &= p.check(isinstance(shape, list) and all(_is_count(d) and d > 0 for d in shape),
                  f"{key}.shape", "must be a list of integers > 0 ([] for one value)",
                  shape)  # fmt: skip
    return Field(name, dtype, tuple(shape)) if ok else None  # type: ignore[arg-type]


def _parts(raw: object, row: int, p: Problems) -> list[PartInfo]:
    if not p.check(isinstance(raw, list) and len(raw) > 0, "parts", "must be a non-empty list",
                   raw if not isinstance(raw, list) else "[]"):  # fmt: skip
        return []
    assert isinstance(raw, list)
    out, names = [], set()
    for i, s in enumerate(raw):
        key = f"parts[{i}]"
        if not p.check(isinstance(s, dict), key, "must be an object", s):
            continue
        info = _part(s, key, row, p)
        if info is not None:
            p.check(info.file not in names, f"{key}.file", "duplicate part file", info.file)
            names.add(info.file)
            out.append(info)
    return out


def _part(s: dict[str, Any], key: str, row: int, p: Problems) -> PartInfo | None:
    file: Any = s.get("file")
    n: Any = s.get("samples")
    size: Any = s.get("bytes")
    digest: Any = s.get("sha256")
    ok = p.check(isinstance(file, str) and _safe_name(file), f"{key}.file",
                 "must be a plain file name (no '/', no '..')", file)  # fmt: skip
    ok &= p.check(_is_count(n) and n > 0, f"{key}.samples", "must be an integer > 0", n)
    ok &= p.check(_is_count(size), f"{key}.bytes", "must be an integer >= 0", size)
    ok &= p.check(_is_hex(digest), f"{key}.sha256", "must be 64 hex digits", digest)
    if ok:
        ok &= p.check(size == n * row, f"{key}.bytes",
                      f"must equal samples x row bytes = {n} x {row} (wrong dtype or seq_len?)",
                      size)  # fmt: skip
    if not ok:
        return None
    src = s.get("source")
    if src is None:
        return PartInfo(file, n, size, digest)
    okay = isinstance(src, dict) and isinstance(src.get("url"), str) and bool(src.get("url"))
    okay = okay and _is_count(src.get("offset")) and _is_count(src.get("size"))
    okay = okay and src["offset"] + size <= src["size"]
    if not p.check(okay, f"{key}.source", "must be {url, offset, size} with offset + bytes "
                   "<= size", src):  # fmt: skip
        return None
    return PartInfo(file, n, size, digest, SourceRef(src["url"], src["offset"], src["size"]))


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_hex(v: object) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _safe_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")
