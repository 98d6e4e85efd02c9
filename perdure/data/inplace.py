"""``perdure data import --in-place``: a dataset whose parts are the token files where they lie.

Nothing is copied. Each source file (a raw token stream, a ``.npy`` 1-D array, a Megatron
``.bin``) becomes one part of a format-version-3 manifest: its ``source`` is the file's URL
(an absolute local path, or an fsspec URL as given), the byte offset of its first token
(the ``.npy`` header's length) and the file's size; ``sha256`` is the SHA-256 of the whole
file. The size and checksum are computed once, at import, on a thread per file (hashlib and
numpy's reductions release the GIL), while another thread scans the ids for their range;
the loader checks the size when the dataset is opened and the checksum on its first read of
the file, so a file changed since is refused with its name (``docs/data.md``).

Each file is cut on its own into samples of ``seq_len + 1`` tokens; its tail is dropped
(a copy import cuts the concatenated stream instead, so with several files the samples
differ at file boundaries; for one file they are the same). The tokens are read as they
are stored: ``uint8``/``uint16``/``uint32``, or ``int8``/``int16``/``int32`` whose ids are
all >= 0 (the same bytes as the unsigned type); ``int64`` files cannot be served in place
(a token dtype is at most 32 bits): import them with a copy.

Limits: local files are hashed here; a remote URL is hashed by streaming it once. The
loader maps (or, remote, fetches) the whole file, and hashes it whole on its first read in
each process.
"""

from __future__ import annotations

import hashlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from perdure.data.errors import DataError
from perdure.data.manifest import Manifest, PartInfo, SourceRef
from perdure.data.output import commit, staged
from perdure.data.store import is_local, open_fs

UNSIGNED = {"uint8": "uint8", "uint16": "uint16", "uint32": "uint32", "int8": "uint8",
            "int16": "uint16", "int32": "uint32"}  # fmt: skip
SCAN = 1 << 24


def import_in_place(
    files: list[str],
    out: str,
    *,
    seq_len: int,
    dtype: str | None = None,
    vocab_size: int | None = None,
    tokenizer: str = "pretokenized",
    overwrite: bool = False,
    note: dict[str, Any] | None = None,
) -> Manifest:
    """Reference ``files`` (token streams; ``dtype`` for raw ones) from a dataset at ``out``."""
    if not files:
        raise DataError("import --in-place: name at least one file")
    if seq_len is None or seq_len < 1:
        raise DataError(f"import --in-place: --seq-len must be >= 1 (got {seq_len})")
    srcs = [_source(f, dtype) for f in files]
    kinds = {k for _, _, k, _ in srcs}
    if len(kinds) > 1:
        raise DataError(f"import --in-place: the files mix dtypes {sorted(kinds)}")
    kind = srcs[0][2]
    row = (seq_len + 1) * np.dtype(kind).itemsize
    with ThreadPoolExecutor(max(1, min(8, 2 * len(srcs)))) as pool:
        digests = [pool.submit(_sha256, url) for url, _, _, _ in srcs]
        ranges = [pool.submit(_range, url, off, kind, size) for url, off, kind, size in srcs]
        digest = [d.result() for d in digests]
        lo_hi = [r.result() for r in ranges]
    lo, hi = min(r[0] for r in lo_hi), max(r[1] for r in lo_hi)
    if lo < 0:
        raise DataError(f"import --in-place: token ids must be >= 0 (got {lo} in {files})")
    vocab = vocab_size if vocab_size is not None else hi + 1
    if hi >= vocab:
        raise DataError(f"import --in-place: token ids must be below --vocab-size {vocab} "
                        f"(got {hi})")  # fmt: skip
    parts = []
    for k, ((url, off, _, size), d) in enumerate(zip(srcs, digest, strict=True)):
        samples = (size - off) // row
        if samples == 0:
            raise DataError(f"{url}: fewer than one sample of {seq_len + 1} tokens")
        name = f"shard-{k:05d}.bin"
        parts.append(PartInfo(name, samples, samples * row, d, SourceRef(url, off, size)))
    build = {"seq_len": seq_len, "samples_per_shard": max(s.samples for s in parts),
             "tokenizer": tokenizer, "vocab_size": vocab}  # fmt: skip
    sources = {"files": len(srcs), "bytes": sum(s for *_, s in srcs), "in_place": True,
               "vocab_size_from": "--vocab-size" if vocab_size is not None else "max_id",
               **(note or {})}  # fmt: skip
    m = Manifest(seq_len, UNSIGNED[kind], tuple(parts), build, sources).with_version_id()
    with staged(out, overwrite, "import") as tmp:
        commit(tmp, out, m)
    return m


def _source(f: str, dtype: str | None) -> tuple[str, int, str, int]:
    """(url, byte offset of the first token, dtype, file size) of one token file."""
    fs, path = open_fs(f)
    local = is_local(fs.protocol)
    url = str(Path(path).resolve()) if local else f
    try:
        size = int(fs.size(path))
    except FileNotFoundError:
        raise DataError(f"{f}: no such file") from None
    offset, kind = 0, dtype
    if f.endswith(".npy"):
        with fs.open(path, "rb") as fh:
            version = np.lib.format.read_magic(fh)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)  # fmt: skip
            shape, _, dt = read(fh)
            offset = fh.tell()
        if len(shape) != 1 or dt.hasobject or (dt.byteorder == ">"):
            raise DataError(f"{f}: --in-place needs a 1-D little-endian .npy (got shape "
                            f"{list(shape)}, dtype {dt.str})")  # fmt: skip
        kind = dt.name
    if kind is None:
        raise DataError(f"{f}: a raw file needs --dtype")
    if kind not in UNSIGNED:
        raise DataError(f"{f}: --in-place serves {sorted(UNSIGNED)} tokens (got {kind}; an "
                        "int64 file needs a copy import)")  # fmt: skip
    if (size - offset) % np.dtype(kind).itemsize:
        raise DataError(f"{f}: {size - offset} bytes of tokens is not a multiple of {kind}")
    return url, offset, kind, size


def _sha256(url: str) -> str:
    fs, path = open_fs(url)
    h = hashlib.sha256()
    if is_local(fs.protocol):  # mapped: no copy into Python bytes
        whole = _mapped(path)
        for a in range(0, whole.size, 1 << 24):
            h.update(whole[a : a + (1 << 24)].data)
        return h.hexdigest()
    with fs.open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def _mapped(path: str) -> np.ndarray:
    if Path(path).stat().st_size == 0:
        return np.empty(0, np.uint8)
    return np.memmap(path, dtype=np.uint8, mode="r")


def _range(url: str, offset: int, kind: str, size: int) -> tuple[int, int]:
    """(smallest, largest) id; unsigned ids are never below 0, so only the largest is
    scanned for them (one pass over the file, not two)."""
    fs, path = open_fs(url)
    dt = np.dtype(kind).newbyteorder("<")
    lo, hi = 0, -1
    signed = dt.kind == "i"
    if is_local(fs.protocol):
        whole = _mapped(path)[offset:]
        ids = whole[: whole.size // dt.itemsize * dt.itemsize].view(dt)
        for a in range(0, ids.size, SCAN):
            part = ids[a : a + SCAN]
            hi = max(hi, int(part.max()))
            lo = min(lo, int(part.min())) if signed else lo
        return lo, hi
    with fs.open(path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(SCAN * dt.itemsize):
            vals = np.frombuffer(chunk[: len(chunk) // dt.itemsize * dt.itemsize], dtype=dt)
            if vals.size:
                lo, hi = min(lo, int(vals.min())), max(hi, int(vals.max()))
    return lo, hi
