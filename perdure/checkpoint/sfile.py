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
from typing import BinaryIO

from perdure.checkpoint.errors import CorruptCheckpointError
from perdure.checkpoint.tensors import ITEMSIZE

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
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(name, f"safetensors header is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CorruptCheckpointError(name, "safetensors header is not a JSON object")
    raw.pop("__metadata__", None)
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


def _entry(name: str, key: str, v: object) -> Entry:
    try:
        assert isinstance(v, dict)
        dtype, shape, (begin, end) = v["dtype"], tuple(v["shape"]), v["data_offsets"]
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= int(d)
        ok = isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end
    except (AssertionError, KeyError, TypeError, ValueError):
        raise CorruptCheckpointError(name, f"malformed header entry for {key!r}: {v!r}") from None
    if not ok or end - begin != n:
        raise CorruptCheckpointError(
            name, f"tensor {key!r}: offsets {[begin, end]} do not hold {dtype} {list(shape)}"
        )
    return Entry(key, dtype, shape, begin, end)
