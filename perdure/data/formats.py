"""Token formats large runs arrive in: Megatron-LM indexed datasets and MosaicML MDS shards.

Both are read by their documented layout, without importing their libraries (which pull in
torch builds, torchvision, cloud clients), into one token stream plus the stream offsets
where documents start; :func:`perdure.data.importer.import_arrays` then cuts the stream into
samples as it does any other.

**Megatron** (``IndexedDataset``, also NeMo's and GPT-NeoX's ``mmap`` format): ``PREFIX.idx``
holds the header ``MMIDIDX\\x00\\x00``, version ``<Q`` (1), a dtype code ``<B`` (1 uint8,
2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16), the sequence count
``<Q``, the document count ``<Q``, then the sequence lengths (int32), their byte pointers
into ``PREFIX.bin`` (int64) and the document indices (int64: the sequence index where each
document starts, first 0, last the sequence count); a multimodal index ends with one int8
mode per sequence. The ``.bin`` is the sequences back to back: a raw token stream, which is
checked (pointers contiguous, sizes summing to the file).

**MDS** (``index.json`` and ``shard.NNNNN.mds``, format version 2): each shard is a uint32
sample count, uint32 offsets (one more than samples), its JSON config, then the samples;
a sample is one uint32 size per variable-size column, then every column's bytes. The token
column is an ``ndarray`` (``ndarray``, ``ndarray:DTYPE`` or ``ndarray:DTYPE:SHAPE``) or
``bytes`` (then ``dtype`` says what the bytes hold). Shards compressed with ``zstd`` are
decompressed (``zstandard``); other codecs are refused by name. Each sample is one document.

Limits: float token dtypes are refused (token ids are integers); an MDS token column must
be one of the encodings above (not ``pkl`` or ``json``).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from perdure.data.errors import DataError
from perdure.data.manifest import Manifest

MEGATRON_HEADER = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64",
                   7: "float32", 8: "uint16"}  # fmt: skip
MDS_VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16",
                    32: "uint32", 33: "int32", 34: "float32", 64: "uint64", 65: "int64",
                    66: "float64"}  # fmt: skip
MDS_SHAPE_DTYPES = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}


@dataclass(frozen=True)
class MegatronIndex:
    bin_path: Path
    dtype: str
    sizes: np.ndarray
    doc_starts: np.ndarray
    """Token offsets in the stream where each document starts."""


def read_megatron(prefix: str) -> MegatronIndex:
    """Read and check ``PREFIX.idx`` against ``PREFIX.bin``; raise naming the file."""
    idx, bin_ = Path(prefix + ".idx"), Path(prefix + ".bin")
    for p in (idx, bin_):
        if not p.is_file():
            raise DataError(f"{p}: no such file (--format megatron PREFIX needs PREFIX.idx "
                            "and PREFIX.bin)")  # fmt: skip
    data = idx.read_bytes()
    if not data.startswith(MEGATRON_HEADER) or len(data) < 34:
        raise DataError(f"{idx}: not a Megatron index (header {data[:9]!r}, want "
                        f"{MEGATRON_HEADER!r})")  # fmt: skip
    version, code = struct.unpack_from("<QB", data, 9)
    if version != 1:
        raise DataError(f"{idx}: index version must be 1 (got {version})")
    if code not in MEGATRON_DTYPES:
        raise DataError(f"{idx}: unknown dtype code {code} (known: {MEGATRON_DTYPES})")
    dtype = MEGATRON_DTYPES[code]
    if dtype.startswith("float"):
        raise DataError(f"{idx}: the tokens are {dtype}; token ids must be integers")
    nseq, ndoc = struct.unpack_from("<QQ", data, 18)
    off = 34
    need = off + 4 * nseq + 8 * nseq + 8 * ndoc
    if len(data) not in (need, need + nseq):
        raise DataError(f"{idx}: {len(data)} bytes, but {nseq} sequences and {ndoc} document "
                        f"indices need {need} (or {need + nseq} with modes)")  # fmt: skip
    sizes = np.frombuffer(data, "<i4", nseq, off).astype(np.int64)
    pointers = np.frombuffer(data, "<i8", nseq, off + 4 * nseq)
    docs = np.frombuffer(data, "<i8", ndoc, off + 12 * nseq)
    item = np.dtype(dtype).itemsize
    expect = np.concatenate([[0], np.cumsum(sizes)[:-1]]) * item if nseq else sizes
    if not np.array_equal(pointers, expect):
        raise DataError(
            f"{idx}: sequence pointers are not contiguous; only indexes written sequence "
            "after sequence (as IndexedDatasetBuilder does) import"
        )
    total = int(sizes.sum()) * item
    if bin_.stat().st_size != total:
        raise DataError(f"{bin_}: {bin_.stat().st_size} bytes, but {idx} says {total}")
    if ndoc == 0 or docs[0] != 0 or docs[-1] != nseq or np.any(np.diff(docs) < 0):
        raise DataError(f"{idx}: document indices must rise from 0 to {nseq}")
    starts = np.concatenate([[0], np.cumsum(sizes)])[docs[:-1]]
    return MegatronIndex(bin_, dtype, sizes, np.unique(starts))


def read_mds(root: str, column: str, dtype: str | None, out: Path) -> tuple[str, np.ndarray]:
    """Write the token column of every sample of the MDS directory ``root`` (shards in
    index order) to ``out`` as one raw stream; return its dtype and the document starts."""
    index_path = Path(root) / "index.json"
    try:
        index = json.loads(index_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{index_path}: not a readable MDS index ({e})") from None
    starts: list[int] = []
    kind: str | None = None
    pos = 0
    with open(out, "wb") as f:
        for k, shard in enumerate(index.get("shards", [])):
            for arr in _mds_shard(Path(root), shard, k, column, dtype):
                if kind is None:
                    kind = arr.dtype.name
                elif arr.dtype.name != kind:
                    raise DataError(f"{root}: column {column!r} mixes {kind} and {arr.dtype.name}")
                starts.append(pos)
                pos += arr.size
                f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    if kind is None:
        raise DataError(f"{index_path}: holds no samples")
    return kind, np.array(starts, dtype=np.int64)


def _mds_shard(root: Path, shard: dict, k: int, column: str, dtype: str | None) -> list[np.ndarray]:
    where = f"{root / 'index.json'}: shards[{k}]"
    if shard.get("format") != "mds" or shard.get("version") != 2:
        raise DataError(f"{where}: must be format 'mds' version 2 (got {shard.get('format')!r} "
                        f"version {shard.get('version')!r})")  # fmt: skip
    names = shard.get("column_names", [])
    if column not in names:
        raise DataError(f"{where}: no column {column!r} (columns: {names}); pass --mds-column")
    data = _shard_bytes(root, shard, where)
    n = struct.unpack_from("<I", data, 0)[0]
    offsets = np.frombuffer(data, "<u4", n + 1, 4)
    col = names.index(column)
    encodings, sizes = shard["column_encodings"], shard["column_sizes"]
    variable = [i for i, s in enumerate(sizes) if s is None]
    out = []
    for i in range(n):
        sample = data[int(offsets[i]) : int(offsets[i + 1])]
        lens = np.frombuffer(sample, "<u4", len(variable), 0)
        at, pos = 4 * len(variable), {}
        for c, s in enumerate(sizes):
            size = int(lens[variable.index(c)]) if s is None else int(s)
            pos[c] = (at, at + size)
            at += size
        a, b = pos[col]
        out.append(_decode(sample[a:b], encodings[col], dtype, f"{where} sample {i}"))
    return out


def _shard_bytes(root: Path, shard: dict, where: str) -> bytes:
    raw = root / shard["raw_data"]["basename"]
    if raw.is_file():
        return raw.read_bytes()
    codec = shard.get("compression")
    zip_data = shard.get("zip_data")
    if not codec or not zip_data:
        raise DataError(f"{raw}: missing (listed in {where})")
    if not str(codec).startswith("zstd"):
        raise DataError(f"{where}: compression {codec!r} is not supported (only zstd); "
                        "decompress the shards first")  # fmt: skip
    import zstandard

    return zstandard.ZstdDecompressor().decompress((root / zip_data["basename"]).read_bytes(),
                                                   max_output_size=1 << 34)  # fmt: skip


def _decode(b: bytes, encoding: str, dtype: str | None, where: str) -> np.ndarray:
    parts = encoding.split(":")
    if parts[0] == "bytes":
        if dtype is None:
            raise DataError(f"{where}: a 'bytes' token column needs --dtype (what the bytes hold)")
        return np.frombuffer(b, dtype=np.dtype(dtype).newbyteorder("<"))
    if parts[0] != "ndarray":
        raise DataError(f"{where}: token column encoding must be ndarray[:DTYPE[:SHAPE]] or "
                        f"bytes (got {encoding!r})")  # fmt: skip
    at = 0
    if len(parts) >= 2:
        kind = parts[1]
    else:
        kind, at = MDS_VALUE_DTYPES[b[0]], 1
    if len(parts) < 3:
        head = b[at]
        ndim, shape_dtype = head >> 2, MDS_SHAPE_DTYPES[head & 3]
        at += 1 + ndim * np.dtype(shape_dtype).itemsize
    arr = np.frombuffer(b, dtype=np.dtype(kind).newbyteorder("<"), offset=at)
    if arr.dtype.kind == "f":
        raise DataError(f"{where}: the tokens are {kind}; token ids must be integers")
    return arr


def import_megatron(prefixes: list[str], out: str, **kw: Any) -> Manifest:
    """Import Megatron indexed datasets (their streams concatenated, in the order given);
    ``kw`` as :func:`~perdure.data.importer.import_arrays` (``seq_len`` needed)."""
    from perdure.data.importer import import_arrays

    if not prefixes:
        raise DataError("import --format megatron: name at least one PREFIX")
    idx = [read_megatron(p) for p in prefixes]
    kinds = {i.dtype for i in idx}
    if len(kinds) > 1:
        raise DataError(f"import --format megatron: the prefixes mix dtypes {sorted(kinds)}")
    note = {"format": "megatron", "documents": sum(i.doc_starts.size for i in idx),
            "sequences": sum(i.sizes.size for i in idx)}  # fmt: skip
    shift = np.cumsum([0] + [int(i.sizes.sum()) for i in idx])
    docs = np.concatenate([i.doc_starts + shift[k] for k, i in enumerate(idx)])
    return import_arrays({"tokens": [str(i.bin_path) for i in idx]}, out, dtype=idx[0].dtype,
                         note=note, documents=docs, **kw)  # fmt: skip


def import_mds(dirs: list[str], out: str, column: str = "tokens", dtype: str | None = None,
               **kw: Any) -> Manifest:  # fmt: skip
    """Import the token column of MDS directories (each sample one document), copied into
    perdure's parts; ``kw`` as :func:`~perdure.data.importer.import_arrays`."""
    from perdure.data.importer import import_arrays

    if not dirs:
        raise DataError("import --format mds: name at least one DIR")
    parent = Path(out).resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    streams, docs, kind = [], 0, None
    starts: list[np.ndarray] = []
    shift = 0
    try:
        for d in dirs:
            fd, tmp = tempfile.mkstemp(prefix=".mds-stream-", dir=parent)
            os.close(fd)
            streams.append(tmp)
            k, first = read_mds(d, column, dtype, Path(tmp))
            if kind not in (None, k):
                raise DataError(f"import --format mds: {d} holds {k} tokens, the others {kind}")
            kind, docs = k, docs + first.size
            starts.append(first + shift)
            shift += Path(tmp).stat().st_size // np.dtype(k).itemsize
        assert kind is not None
        note = {"format": "mds", "documents": docs, "mds_column": column}
        return import_arrays({"tokens": streams}, out, dtype=kind, note=note,
                             documents=np.concatenate(starts), **kw)  # fmt: skip
    finally:
        for t in streams:
            Path(t).unlink(missing_ok=True)
