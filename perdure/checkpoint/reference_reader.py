"""Reference reader of perdure checkpoint format v1, using only the standard library and
numpy (no torch, no safetensors package), written from docs/checkpoint-format.md.

This file stands alone: copy it anywhere and run ``python reference_reader.py CKPT_DIR``
to verify a checkpoint and list its tensors. It is deliberately simple (one file read at
a time, no threads), which makes it slower than the torch loader, never less strict.

dtypes map to numpy as little-endian equivalents. numpy has no bfloat16 and no float8:
``BF16`` is returned upcast to float32 by default (exact: every bf16 value is a float32),
or as its raw uint16 bits with ``bf16="bits"``; ``F8_E4M3``/``F8_E5M2`` as raw uint8 bits.
"""

from __future__ import annotations

import json
import math
import struct
import sys
import zlib
from pathlib import Path
from typing import Any

import numpy as np

FORMAT_NAME = "perdure-checkpoint"
MAJOR = 1
MANIFEST = "manifest.json"
_READ = 16 << 20
_NUMPY = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "BF16": "<u2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
    "U8": "u1",
    "U16": "<u2",
    "U32": "<u4",
    "U64": "<u8",
    "BOOL": "?",
    "F8_E4M3": "u1",
    "F8_E5M2": "u1",
}


class ReaderError(Exception):
    """A checkpoint cannot be read; the message starts with the offending file."""


def _fail(path: Path | str, problem: str) -> ReaderError:
    return ReaderError(f"{path}: {problem}")


class Checkpoint:
    """One checkpoint directory. ``verify`` checks every file's size and CRC-32 on open."""

    def __init__(self, path: str | Path, *, verify: bool = True) -> None:
        self.path = Path(path)
        self.manifest = _read_manifest(self.path / MANIFEST)
        self._headers: dict[str, tuple[int, dict[str, Any]]] = {}
        for name, rec in self.manifest["files"].items():
            _check_size(self.path / name, rec["bytes"])
        if verify:
            for name, rec in self.manifest["files"].items():
                _check_crc(self.path / name, rec["checksum"])

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def tensor_names(self) -> list[str]:
        """Stored tensor names: ``model/<param>`` and ``optimizer/<path>``."""
        return list(self.manifest["tensors"])

    def context(self) -> dict[str, Any]:
        """The context file as plain data (tagged values decoded; tensors left as
        ``{"$tensor": name}``, readable with :meth:`tensor`)."""
        name = self.manifest["context"]
        try:
            return _decode(json.loads((self.path / name).read_bytes()))
        except json.JSONDecodeError as e:
            raise _fail(self.path / name, f"not valid JSON ({e})") from None

    def tensor(self, name: str, rows: tuple[int, int] | None = None, bf16: str = "float32") -> Any:
        """Tensor ``name`` (or rows ``[start, stop)`` of its first dimension) as numpy."""
        try:
            t = self.manifest["tensors"][name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None
        shape, dtype = tuple(t["shape"]), np.dtype(_NUMPY[t["dtype"]])
        lo, hi = (0, shape[0] if shape else 0) if rows is None else rows
        if shape and not 0 <= lo <= hi <= shape[0]:
            raise ValueError(f"{name}: rows {lo}:{hi} outside [0, {shape[0]}]")
        out = np.empty((hi - lo, *shape[1:]) if shape else (), dtype=dtype)
        row_bytes = dtype.itemsize * math.prod(shape[1:]) if shape else out.nbytes
        flat = out.reshape(-1).view(np.uint8)
        for c in t["chunks"]:
            a, b = c["rows"] if c["rows"] is not None else (0, 0)
            s, e = (max(a, lo), min(b, hi)) if shape else (0, 0)
            if shape and s >= e:
                continue
            start = self._offset(c["file"], c["key"]) + (s - a) * row_bytes
            n = (e - s) * row_bytes if shape else out.nbytes
            dest = flat[(s - lo) * row_bytes : (s - lo) * row_bytes + n]
            _read_into(self.path / c["file"], start, dest)
        if t["dtype"] == "BF16" and bf16 == "float32":
            return (out.astype(np.uint32) << 16).view(np.float32)
        return out

    def _offset(self, file: str, key: str) -> int:
        if file not in self._headers:
            self._headers[file] = _read_header(self.path / file)
        start, entries = self._headers[file]
        if key not in entries:
            raise _fail(self.path / file, f"no tensor {key!r} in the safetensors header")
        return start + entries[key]["data_offsets"][0]


def _read_manifest(path: Path) -> dict[str, Any]:
    try:
        m = json.loads(path.read_text())
    except FileNotFoundError:
        raise _fail(path, "missing: the checkpoint is not committed") from None
    except json.JSONDecodeError as e:
        raise _fail(path, f"not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise _fail(path, f"not a {FORMAT_NAME} manifest")
    version = m.get("version") or {}
    if version.get("major") != MAJOR:
        raise _fail(
            path,
            f"format version {version.get('major')}.{version.get('minor')} "
            f"is not supported (this reader knows major {MAJOR})",
        )
    return m


def _check_size(path: Path, expected: int) -> None:
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise _fail(path, "missing (listed in the manifest)") from None
    if size != expected:
        raise _fail(path, f"size is {size} bytes, the manifest says {expected}")


def _check_crc(path: Path, checksum: str) -> None:
    algo, _, want = checksum.partition(":")
    if algo != "crc32":
        raise _fail(path, f"unsupported checksum algorithm {algo!r}")
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            crc = zlib.crc32(chunk, crc)
    if f"{crc:08x}" != want:
        raise _fail(path, f"checksum mismatch: manifest says crc32 {want}, file has {crc:08x}")


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise _fail(path, "truncated: no safetensors header")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise _fail(path, f"header length {n} runs past the file ({size} bytes)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    for key, e in header.items():
        if 8 + n + e["data_offsets"][1] > size:
            raise _fail(path, f"tensor {key!r} offsets {e['data_offsets']} run past the file")
    return 8 + n, header


def _read_into(path: Path, offset: int, dest: Any) -> None:
    with open(path, "rb") as f:
        f.seek(offset)
        view = memoryview(dest)
        while len(view):
            got = f.readinto(view[:_READ])
            if not got:
                raise _fail(path, "truncated: the file ends before its data does")
            view = view[got:]


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    if len(value) == 1:
        ((tag, inner),) = value.items()
        if tag == "$tuple":
            return tuple(_decode(v) for v in inner)
        if tag == "$float":
            return float(inner)
        if tag == "$dict":
            return {_key(_decode(k)): _decode(v) for k, v in inner}
        if tag == "$tensor":
            return value
    return {k: _decode(v) for k, v in value.items()}


def _key(k: Any) -> Any:
    return tuple(_key(x) for x in k) if isinstance(k, (list, tuple)) else k


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: reference_reader.py CHECKPOINT_DIR", file=sys.stderr)
        return 2
    try:
        ckpt = Checkpoint(argv[0])
    except ReaderError as e:
        print(f"corrupt: {e}", file=sys.stderr)
        return 1
    print(f"step {ckpt.step}: {len(ckpt.tensor_names())} tensors, checksums ok")
    for name in ckpt.tensor_names():
        t = ckpt.manifest["tensors"][name]
        print(f"  {name} {t['dtype']} {t['shape']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
