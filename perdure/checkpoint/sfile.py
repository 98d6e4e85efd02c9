"""The safetensors file format, written and read by hand, streaming from tensor memory.

Layout (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 ``N``, then
``N`` bytes of JSON header ``{key: {"dtype", "shape", "data_offsets": [begin, end]},
"__metadata__": {str: str}}`` padded with spaces so the data starts 8-byte aligned, then
the data: tensors back to back, little-endian, C order, offsets relative to the data start.
Writing it ourselves avoids ``safetensors.torch.save_file``, which builds the whole file
in memory first.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import BinaryIO, TypeGuard

from perdure.checkpoint.codec import loads_strict
from perdure.checkpoint.errors import CorruptCheckpointError
from perdure.checkpoint.layout import DTYPE_SIZES, MAX_COUNT

MAX_HEADER = 100 << 20
"""Refuse headers above this size (the safetensors library uses the same limit)."""


def build_header(entries: list[tuple[str, str, tuple[int, ...], int]]) -> bytes:
    """Length prefix plus padded header for ``(key, dtype, shape, nbytes)`` in data order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt", "writer": "perdure"}}
    offset = 0
    for key, dtype, shape, nbytes in entries:
        header[key] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)
    return struct.pack("<Q", len(raw)) + raw


@dataclass(frozen=True)
class Entry:
    key: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    prefix: bytes
    """The length field and the JSON header, as read (they are covered by the checksum)."""
    data_start: int
    entries: dict[str, Entry]
    """In data order."""


def read_header(f: BinaryIO, name: str, size: int) -> Header:
    """Parse and check a header: every offset inside the file, tensors back to back,
    sizes matching dtype and shape. ``name`` is used in errors."""
    head = f.read(8)
    if len(head) < 8:
        raise CorruptCheckpointError(name, f"truncated: {size} bytes, no safetensors header")
    (n,) = struct.unpack("<Q", head)
    if n > MAX_HEADER or 8 + n > size:
        raise CorruptCheckpointError(name, f"header length {n} runs past the file ({size} bytes)")
    text = f.read(n)
    raw = loads_strict(text, name, "safetensors header")
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(name, "safetensors header is not a JSON object")
    meta = raw.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CorruptCheckpointError(name, "safetensors __metadata__ is not an object of strings")
    entries = sorted((_entry(name, k, v) for k, v in raw.items()), key=lambda e: e.begin)
    pos = 0
    for ent in entries:
        if ent.begin != pos:
            raise CorruptCheckpointError(
                name, f"tensor {ent.key!r} starts at {ent.begin}, expected {pos}"
            )
        pos = ent.end
    if 8 + n + pos != size:
        raise CorruptCheckpointError(
            name, f"tensor data runs to byte {8 + n + pos} but the file has {size} bytes"
        )
    return Header(head + text, 8 + n, {e.key: e for e in entries})


def _counts(v: object) -> TypeGuard[list[int]]:
    """A JSON list of ints (not bools) in ``[0, 2**53)``."""
    return isinstance(v, list) and all(type(d) is int and 0 <= d < MAX_COUNT for d in v)


def _entry(name: str, key: str, v: object) -> Entry:
    """One header entry: a known dtype, a shape of ints, offsets ``[begin, end]`` whose
    length is exactly the dtype's size times the shape's product."""
    bad = CorruptCheckpointError(name, f"malformed header entry for {key!r}: {v!r:.120}")
    if not isinstance(v, dict):
        raise bad
    dtype, shape, offsets = v.get("dtype"), v.get("shape"), v.get("data_offsets")
    if not (isinstance(dtype, str) and dtype in DTYPE_SIZES and _counts(shape)):
        raise bad
    if not (_counts(offsets) and len(offsets) == 2 and offsets[0] <= offsets[1]):
        raise bad
    n = DTYPE_SIZES[dtype]
    for d in shape:
        n *= d
    begin, end = offsets
    if end - begin != n:
        raise CorruptCheckpointError(
            name, f"tensor {key!r}: offsets {[begin, end]} do not hold {dtype} {shape}"
        )
    return Entry(key, dtype, tuple(shape), begin, end)
