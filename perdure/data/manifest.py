"""``manifest.json``: what a dataset holds, how to read it, and its content address.

The manifest is the only metadata of a dataset. Shards are raw little-endian arrays of
shape ``[samples, seq_len + 1]`` whose dtype is in ``sample.dtype``; the manifest gives each
shard's sample count, byte size and SHA-256. The *version id* is a SHA-256 over the shard
checksums and the build parameters that give the tokens their meaning (see
:func:`version_id`), so any change of content or meaning changes it, and two builds of the
same content agree on it on any machine. Schema: ``docs/data.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from perdure.data.errors import DataError, Problems
from perdure.data.hashing import canonical_hash

FORMAT = "perdure-dataset"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
DTYPES = ("uint8", "uint16", "uint32")
"""Allowed token dtypes, always stored little-endian."""


@dataclass(frozen=True)
class ShardInfo:
    """One shard file: name relative to the dataset root, rows, bytes and SHA-256 (hex)."""

    file: str
    samples: int
    bytes: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "samples": self.samples, "bytes": self.bytes,
                "sha256": self.sha256}  # fmt: skip


@dataclass(frozen=True)
class Manifest:
    """A parsed, validated manifest. ``build`` holds the parameters that enter the id."""

    seq_len: int
    dtype: str
    shards: tuple[ShardInfo, ...]
    build: dict[str, Any] = field(default_factory=dict)
    sources: dict[str, Any] = field(default_factory=dict)
    """Informational (file count, bytes read); not part of the version id, since the same
    content read from other paths is the same dataset."""
    version_id: str = ""

    @property
    def sample_shape(self) -> tuple[int]:
        return (self.seq_len + 1,)

    @property
    def row_bytes(self) -> int:
        return (self.seq_len + 1) * np.dtype(self.dtype).itemsize

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return self.num_samples * (self.seq_len + 1)

    def np_dtype(self) -> np.dtype:
        return np.dtype(self.dtype).newbyteorder("<")

    def with_version_id(self) -> Manifest:
        return Manifest(self.seq_len, self.dtype, self.shards, self.build, self.sources,
                        version_id(self))  # fmt: skip

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "version_id": self.version_id,
            "sample": {"dtype": self.dtype, "byte_order": "little", "shape": [self.seq_len + 1]},
            "seq_len": self.seq_len,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "build": self.build,
            "sources": self.sources,
            "shards": [s.to_dict() for s in self.shards],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"


def version_id(m: Manifest) -> str:
    """``sha256:<hex>`` over the format version, sample layout, build parameters and every
    shard's (file, samples, bytes, sha256), in shard order."""
    return canonical_hash({
        "format_version": FORMAT_VERSION,
        "sample": {"dtype": m.dtype, "shape": [m.seq_len + 1]},
        "build": m.build,
        "shards": [[s.file, s.samples, s.bytes, s.sha256] for s in m.shards],
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
    p.check(fv == FORMAT_VERSION, "format_version", f"must be {FORMAT_VERSION}", fv)
    seq_len, dtype = _sample(data, p)
    shards = _shards(data.get("shards"), seq_len, dtype, p)
    build, sources = data.get("build", {}), data.get("sources", {})
    p.check(isinstance(build, dict), "build", "must be an object", build)
    p.check(isinstance(sources, dict), "sources", "must be an object", sources)
    p.done()
    m = Manifest(seq_len, dtype, tuple(shards), build, sources).with_version_id()
    vid = data.get("version_id")
    p.check(vid == m.version_id, "version_id", f"does not match the content ({m.version_id})", vid)
    n = data.get("num_samples")
    p.check(n == m.num_samples, "num_samples", f"must equal the shards' sum {m.num_samples}", n)
    p.done()
    return m


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


def _shards(raw: object, seq_len: int, dtype: str, p: Problems) -> list[ShardInfo]:
    if not p.check(isinstance(raw, list) and len(raw) > 0, "shards", "must be a non-empty list",
                   raw if not isinstance(raw, list) else "[]"):  # fmt: skip
        return []
    assert isinstance(raw, list)
    row = (seq_len + 1) * np.dtype(dtype).itemsize
    out, names = [], set()
    for i, s in enumerate(raw):
        key = f"shards[{i}]"
        if not p.check(isinstance(s, dict), key, "must be an object", s):
            continue
        info = _shard(s, key, row, p)
        if info is not None:
            p.check(info.file not in names, f"{key}.file", "duplicate shard file", info.file)
            names.add(info.file)
            out.append(info)
    return out


def _shard(s: dict[str, Any], key: str, row: int, p: Problems) -> ShardInfo | None:
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
    return ShardInfo(file, n, size, digest) if ok else None


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_hex(v: object) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _safe_name(name: str) -> bool:
    return bool(name) and "/" not in name and "\\" not in name and name not in (".", "..")
