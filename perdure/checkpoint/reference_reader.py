"""Reference reader of perdure checkpoint format 1.x (1.0 and 1.1), using only the
standard library and numpy (no torch, no safetensors package), written from
docs/checkpoint-format.md.

This file stands alone: copy it anywhere and run ``python reference_reader.py CKPT_DIR``
to verify a checkpoint and list its tensors. It is deliberately simple (one file read at
a time, no threads), which makes it slower than the torch loader, never less strict:
opening a checkpoint checks every rule of the spec (the manifest's seal, its structure,
file sizes, every safetensors header against the manifest, the context) before any
tensor is read, and every failure is a :class:`ReaderError` naming the file and the rule.

dtypes map to numpy as little-endian equivalents. numpy has no bfloat16 and no float8:
``BF16`` is returned upcast to float32 by default (exact: every bf16 value is a float32),
or as its raw uint16 bits with ``bf16="bits"``; ``F8_E4M3``/``F8_E5M2`` as raw uint8 bits.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import stat
import struct
import sys
import warnings
import zlib
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

FORMAT_NAME = "perdure-checkpoint"
MAJOR = 1
SEALED_SINCE_MINOR = 1
MANIFEST = "manifest.json"
MAX_COUNT = 1 << 53
MAX_MANIFEST = 256 << 20
MAX_HEADER = 100 << 20
_READ = 16 << 20
_SEAL = re.compile(rb' "manifest_checksum": "sha256:([0-9a-f]{64})"\n}\n\Z')
_SEAL_BYTES = 98
_CRC = re.compile(r"crc32:[0-9a-f]{8}")
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
_SIZE = {name: np.dtype(code).itemsize for name, code in _NUMPY.items()}
_CONTEXT = {
    "step": int,
    "optimizer": dict,
    "rng": dict,
    "data": dict,
    "config_hash": str,
    "canonical_config": dict,
    "topology": dict,
    "provenance": dict,
    "decisions": list,
}


class ReaderError(Exception):
    """A checkpoint cannot be read; the message starts with the offending file."""


class LegacyManifestWarning(UserWarning):
    """A format 1.0 manifest: it has no seal, so only its structure could be checked."""


def _fail(path: Path | str, problem: str) -> ReaderError:
    return ReaderError(f"{path}: {problem}")


class Checkpoint:
    """One checkpoint directory, checked against every rule of the spec on open;
    ``verify`` also checks every file's CRC-32."""

    def __init__(self, path: str | Path, *, verify: bool = True) -> None:
        self.path = Path(path)
        self.manifest, self.sealed = _read_manifest(self.path)
        mpath = self.path / MANIFEST
        self._tensors = {
            name: _tensor_entry(mpath, name, e, self.manifest["files"])
            for name, e in self.manifest["tensors"].items()
        }
        held = _held(mpath, self._tensors, self.manifest["context"])
        for name, rec in self.manifest["files"].items():
            _check_file(self.path / name, rec["bytes"])
        self._headers = {f: _read_header(self.path / f) for f in sorted(held)}
        for f, chunks in held.items():
            _match_header(self.path / f, self._headers[f][1], chunks)
        if verify:
            for name, rec in self.manifest["files"].items():
                _check_crc(self.path / name, rec["checksum"])
        self.context()

    @property
    def step(self) -> int:
        return int(self.manifest["step"])

    def tensor_names(self) -> list[str]:
        """Stored tensor names: ``model/<param>`` and ``optimizer/<path>``."""
        return list(self.manifest["tensors"])

    def context(self) -> dict[str, Any]:
        """The context file as plain data (tagged values decoded; tensors left as
        ``{"$tensor": name}``, readable with :meth:`tensor`), checked: UTF-8 JSON, every
        field, the manifest's step, each optimizer tensor referenced exactly once."""
        name = self.manifest["context"]
        file = self.path / name
        data = _read_file(file)
        if len(data) != self.manifest["files"][name]["bytes"]:
            raise _fail(file, "changed size while being read")
        ctx = _loads(data, file)
        _check_context(file, ctx, self.step, self._tensors)
        try:
            out = _decode(ctx)
        except (KeyError, TypeError, ValueError, RecursionError) as e:
            raise _fail(file, f"malformed tagged value ({e})") from None
        for key, tp in _CONTEXT.items():
            if not isinstance(out[key], tp):
                raise _fail(file, f"field {key!r} decodes to a non-{tp.__name__}")
        return out  # type: ignore[no-any-return]

    def tensor(self, name: str, rows: tuple[int, int] | None = None, bf16: str = "float32") -> Any:
        """Tensor ``name`` (or rows ``[start, stop)`` of its first dimension) as numpy."""
        try:
            dtype_name, shape, chunks = self._tensors[name]
        except KeyError:
            raise KeyError(f"{self.path}: no tensor {name!r}") from None
        dtype = np.dtype(_NUMPY[dtype_name])
        lo, hi = (0, shape[0] if shape else 0) if rows is None else rows
        if shape and not 0 <= lo <= hi <= shape[0]:
            raise ValueError(f"{name}: rows {lo}:{hi} outside [0, {shape[0]}]")
        out = np.empty((hi - lo, *shape[1:]) if shape else (), dtype=dtype)
        row_bytes = dtype.itemsize * math.prod(shape[1:]) if shape else out.nbytes
        flat = out.reshape(-1).view(np.uint8)
        filled = 0
        for file, key, a, b in chunks:
            s, e = (max(a, lo), min(b, hi)) if shape else (0, 1)
            if s >= e:
                continue
            start = self._offset(file, key) + (s - a) * row_bytes
            n = (e - s) * row_bytes if shape else out.nbytes
            dest = flat[(s - lo) * row_bytes : (s - lo) * row_bytes + n]
            _read_into(self.path / file, start, dest)
            filled += e - s
        assert filled == (hi - lo if shape else 1), "chunks cover each row once (checked)"
        if dtype_name == "BF16" and bf16 == "float32":
            return (out.astype(np.uint32) << 16).view(np.float32)
        return out

    def _offset(self, file: str, key: str) -> int:
        start, entries = self._headers[file]
        return start + entries[key]["data_offsets"][0]


# --- strict JSON -------------------------------------------------------------------------


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        keys = [k for k, _ in pairs]
        raise ValueError(f"key {next(k for k in keys if keys.count(k) > 1)!r} appears twice")
    return out


def _constant(name: str) -> Any:
    raise ValueError(f"bare {name} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} overflows a double")
    return value


def _loads(data: bytes, path: Path, what: str = "") -> Any:
    """UTF-8 JSON with no repeated key, no NaN/Infinity, no overflowing number."""
    isnot = f"{what} is not" if what else "not"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"{isnot} UTF-8 (byte {e.start})") from None
    try:
        return json.loads(
            text, object_pairs_hook=_pairs, parse_constant=_constant, parse_float=_float
        )
    except (ValueError, RecursionError) as e:
        raise _fail(path, f"{isnot} valid JSON ({e})") from None


# --- manifest ----------------------------------------------------------------------------


def _read_manifest(dirpath: Path) -> tuple[dict[str, Any], bool]:
    """The manifest, its seal (or format 1.0), format, version and top-level fields."""
    path = dirpath / MANIFEST
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST + 1)
    except FileNotFoundError:
        raise _fail(path, "missing: the checkpoint is not committed") from None
    except OSError as e:
        raise _fail(path, f"unreadable ({e.strerror or e})") from None
    if len(data) > MAX_MANIFEST:
        raise _fail(path, f"larger than {MAX_MANIFEST} bytes")
    seal = _seal(path, data)
    m = _loads(data, path)
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise _fail(path, f"not a {FORMAT_NAME} manifest")
    minor = _version(path, m)
    if seal is not None and m.get("manifest_checksum") != seal:
        raise _fail(path, "field 'manifest_checksum' disagrees with the seal")
    if seal is None and minor >= SEALED_SINCE_MINOR:
        raise _fail(path, f"no valid seal: a format 1.{minor} manifest must end with its seal")
    if seal is None:
        warnings.warn(LegacyManifestWarning(f"{path}: format 1.0, no seal"), stacklevel=3)
    _check_top(path, m, dirpath.name)
    return m, seal is not None


def _seal(path: Path, data: bytes) -> str | None:
    match = _SEAL.search(data, max(0, len(data) - _SEAL_BYTES))
    if match is None:
        return None
    got = hashlib.sha256(data[: match.start()]).hexdigest()
    if got != match.group(1).decode():
        raise _fail(path, f"checksum mismatch: the seal says sha256 {match.group(1).decode()}")
    return f"sha256:{got}"


def _version(path: Path, m: dict[str, Any]) -> int:
    version = m.get("version")
    major = version.get("major") if isinstance(version, dict) else None
    minor = version.get("minor") if isinstance(version, dict) else None
    if type(major) is not int or major != MAJOR:
        raise _fail(
            path,
            f"format version {major!r:.20}.{minor!r:.20} is not supported "
            f"(this reader knows major {MAJOR})",
        )
    if type(minor) is not int or minor < 0:
        raise _fail(path, f"version minor {minor!r:.20} is not an int >= 0")
    return minor


def _count(v: Any) -> bool:
    return type(v) is int and 0 <= v < MAX_COUNT


def _plain(path: Path, name: Any, what: str) -> str:
    """A listed file is directly inside the checkpoint: no '/', '\\', NUL, '.', '..'."""
    bad = not isinstance(name, str) or name in ("", ".", "..", MANIFEST)
    if bad or any(c in name for c in "/\\\0"):
        raise _fail(path, f"{what} {name!r:.80} is not a plain file name in the checkpoint")
    return name


def _check_top(path: Path, m: dict[str, Any], dirname: str) -> None:
    if not _count(m.get("step")):
        raise _fail(path, f"step {m.get('step')!r:.40} is not an int >= 0")
    named = re.fullmatch(r"step-(\d+)", dirname)
    if named and int(named.group(1)) != m["step"]:
        raise _fail(path, f"step {m['step']} disagrees with the directory name {dirname}")
    for key, tp in (("files", dict), ("tensors", dict), ("context", str)):
        if not isinstance(m.get(key), tp):
            raise _fail(path, f"field {key!r} is missing or not a {tp.__name__}")
    for name, rec in m["files"].items():
        _plain(path, name, "listed file")
        if not isinstance(rec, dict) or not _count(rec.get("bytes")):
            raise _fail(path, f"files[{name!r}]: 'bytes' is not an int in [0, 2**53)")
        if not isinstance(rec.get("checksum"), str) or not _CRC.fullmatch(rec["checksum"]):
            raise _fail(path, f"files[{name!r}]: checksum is not 'crc32:<8 lower-case hex>'")
    if _plain(path, m["context"], "context file") not in m["files"]:
        raise _fail(path, f"context file {m['context']!r} is not listed in 'files'")


Chunk = tuple[str, str, int, int]
"""``(file, key, start, stop)``; a 0-d tensor's one chunk has start = stop = 0."""


def _tensor_entry(
    path: Path, name: str, e: Any, files: dict[str, Any]
) -> tuple[str, tuple[int, ...], list[Chunk]]:
    """(dtype, shape, chunks) of a tensor entry that obeys every rule of section 3."""
    what = f"tensor {name!r}"
    if not name.startswith(("model/", "optimizer/")) or name in ("model/", "optimizer/"):
        raise _fail(path, f"{what}: names start with 'model/' or 'optimizer/'")
    if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in _SIZE:
        raise _fail(path, f"{what}: missing or unknown dtype")
    shape = e.get("shape")
    if not isinstance(shape, list) or not all(_count(d) for d in shape):
        raise _fail(path, f"{what}: shape is not a list of ints in [0, 2**53)")
    if _SIZE[e["dtype"]] * math.prod(max(d, 1) for d in shape) >= MAX_COUNT:
        raise _fail(path, f"{what}: shape {shape} spans more than 2**53 bytes")
    raw = e.get("chunks")
    if not isinstance(raw, list) or not raw:
        raise _fail(path, f"{what}: 'chunks' must list at least one chunk")
    chunks = [_chunk(path, f"{what} chunk {i}", c, bool(shape), files) for i, c in enumerate(raw)]
    _check_cover(path, what, tuple(shape), chunks)
    for i, (_, key, a, b) in enumerate(chunks):
        want = name if len(chunks) == 1 else f"{name}[{a}:{b}]"
        if key != want:
            raise _fail(path, f"{what} chunk {i}: key {key!r} should be {want!r}")
    return e["dtype"], tuple(shape), chunks


def _chunk(path: Path, what: str, c: Any, has_rows: bool, files: dict[str, Any]) -> Chunk:
    if not isinstance(c, dict):
        raise _fail(path, f"{what} is not a JSON object")
    file = _plain(path, c.get("file"), f"{what}: file")
    if file not in files:
        raise _fail(path, f"{what}: file {file!r} is not listed in 'files'")
    if not isinstance(c.get("key"), str):
        raise _fail(path, f"{what}: key is not a string")
    rows = c.get("rows")
    if not has_rows:
        if rows is not None:
            raise _fail(path, f"{what}: a 0-d tensor's chunk has rows null")
        return file, c["key"], 0, 0
    if not (isinstance(rows, list) and len(rows) == 2 and all(_count(r) for r in rows)):
        raise _fail(path, f"{what}: rows {rows!r:.40} is not [start, stop]")
    return file, c["key"], rows[0], rows[1]


def _check_cover(path: Path, what: str, shape: tuple[int, ...], chunks: list[Chunk]) -> None:
    """Sorted, non-empty, back to back, covering ``[0, shape[0])``: each row once."""
    if not shape:
        if len(chunks) != 1:
            raise _fail(path, f"{what}: a 0-d tensor has exactly one chunk")
        return
    pos = 0
    for i, (_, _, a, b) in enumerate(chunks):
        if a != pos:
            raise _fail(path, f"{what} chunk {i}: rows [{a}, {b}) start at {a}, expected {pos}")
        if b <= a and not (shape[0] == 0 and len(chunks) == 1):
            raise _fail(path, f"{what} chunk {i}: rows [{a}, {b}) are empty")
        pos = b
    if pos != shape[0]:
        raise _fail(path, f"{what}: chunks cover rows [0, {pos}), the shape has {shape[0]}")


def _held(
    path: Path, tensors: dict[str, tuple[str, tuple[int, ...], list[Chunk]]], context: str
) -> dict[str, dict[str, tuple[str, tuple[int, ...]]]]:
    """``{file: {key: (dtype, shape the header must give)}}``; no key twice per file."""
    out: dict[str, dict[str, tuple[str, tuple[int, ...]]]] = {}
    for dtype, shape, chunks in tensors.values():
        for file, key, a, b in chunks:
            keys = out.setdefault(file, {})
            if key in keys:
                raise _fail(path, f"file {file!r} key {key!r} is claimed by two chunks")
            keys[key] = (dtype, (b - a, *shape[1:]) if shape else ())
    if context in out:
        raise _fail(path, f"context file {context!r} also holds tensor chunks")
    return out


# --- files -------------------------------------------------------------------------------


def _read_file(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise _fail(path, f"unreadable ({e.strerror or e})") from None


def _check_file(path: Path, expected: int) -> None:
    try:
        st = path.stat()
    except FileNotFoundError:
        raise _fail(path, "missing (listed in the manifest)") from None
    except OSError as e:
        raise _fail(path, f"unreadable ({e.strerror or e})") from None
    if not stat.S_ISREG(st.st_mode):
        raise _fail(path, "not a regular file")
    if st.st_size != expected:
        raise _fail(path, f"size is {st.st_size} bytes, the manifest says {expected}")


def _check_crc(path: Path, checksum: str) -> None:
    want = checksum.partition(":")[2]
    crc = 0
    try:
        with open(path, "rb") as f:
            while chunk := f.read(_READ):
                crc = zlib.crc32(chunk, crc)
    except OSError as e:
        raise _fail(path, f"unreadable ({e.strerror or e})") from None
    if f"{crc:08x}" != want:
        raise _fail(path, f"checksum mismatch: manifest says crc32 {want}, file has {crc:08x}")


def _read_header(path: Path) -> tuple[int, dict[str, Any]]:
    """(data start, entries) of a safetensors file, every rule of section 4 checked."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise _fail(path, "truncated: no safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER or 8 + n > size:
                raise _fail(path, f"header length {n} runs past the file ({size} bytes)")
            text = f.read(n)
    except OSError as e:
        raise _fail(path, f"unreadable ({e.strerror or e})") from None
    header = _loads(text, path, "safetensors header")
    if not isinstance(header, dict):
        raise _fail(path, "safetensors header is not a JSON object")
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise _fail(path, "safetensors __metadata__ is not an object of strings")
    for key, entry in header.items():
        _check_header_entry(path, key, entry)
    pos = 0
    for key, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        if entry["data_offsets"][0] != pos:
            raise _fail(path, f"tensor {key!r} offsets {entry['data_offsets']} leave a gap")
        pos = entry["data_offsets"][1]
    if 8 + n + pos != size:
        raise _fail(path, f"tensor data runs to byte {8 + n + pos}, past the file ({size} bytes)")
    return 8 + n, header


def _counts(v: Any) -> TypeGuard[list[int]]:
    return isinstance(v, list) and all(_count(d) for d in v)


def _check_header_entry(path: Path, key: str, e: Any) -> None:
    if not isinstance(e, dict) or not isinstance(e.get("dtype"), str) or e["dtype"] not in _SIZE:
        raise _fail(path, f"malformed header entry for {key!r}: no known dtype")
    shape, offsets = e.get("shape"), e.get("data_offsets")
    if not _counts(shape) or not _counts(offsets) or len(offsets) != 2:
        raise _fail(path, f"malformed header entry for {key!r}: shape or offsets")
    if offsets[1] - offsets[0] != _SIZE[e["dtype"]] * math.prod(shape):
        raise _fail(path, f"tensor {key!r}: offsets {offsets} do not hold {e['dtype']} {shape}")


def _match_header(
    path: Path, entries: dict[str, Any], held: dict[str, tuple[str, tuple[int, ...]]]
) -> None:
    """The header holds exactly the manifest's chunks, with its dtypes and shapes."""
    if set(entries) != set(held):
        missing, extra = sorted(set(held) - set(entries)), sorted(set(entries) - set(held))
        raise _fail(path, f"header and manifest disagree: missing {missing[:5]}, extra {extra[:5]}")
    for key, (dtype, shape) in held.items():
        e = entries[key]
        if e["dtype"] != dtype or tuple(e["shape"]) != shape:
            raise _fail(
                path,
                f"{key!r} is stored as {e['dtype']} {e['shape']}, "
                f"the manifest says {dtype} {list(shape)}",
            )


def _read_into(path: Path, offset: int, dest: Any) -> None:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            view = memoryview(dest)
            while len(view):
                got = f.readinto(view[:_READ])
                if not got:
                    raise _fail(path, "truncated: the file ends before its data does")
                view = view[got:]
    except OSError as e:
        raise _fail(path, f"unreadable ({e.strerror or e})") from None


# --- context -----------------------------------------------------------------------------


def _check_context(path: Path, ctx: Any, step: int, tensors: dict[str, Any]) -> None:
    if not isinstance(ctx, dict):
        raise _fail(path, "not a JSON object")
    for key, tp in _CONTEXT.items():
        if not isinstance(ctx.get(key), tp) or (tp is int and type(ctx[key]) is not int):
            raise _fail(path, f"field {key!r} is missing or not a {tp.__name__}")
    if ctx["step"] != step:
        raise _fail(path, f"step {ctx['step']} disagrees with the manifest's {step}")
    refs = sorted(_refs(path, ctx["optimizer"]))
    if refs != sorted(n for n in tensors if n.startswith("optimizer/")):
        raise _fail(path, "the optimizer does not reference each optimizer/ tensor exactly once")


def _refs(path: Path, value: Any) -> list[str]:
    out, stack = [], [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
        elif isinstance(v, dict) and len(v) == 1 and "$tensor" in v:
            if not isinstance(v["$tensor"], str):
                raise _fail(path, "a $tensor reference is not a name")
            out.append(v["$tensor"])
        elif isinstance(v, dict):
            stack.extend(v.values())
    return out


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
        with warnings.catch_warnings(record=True) as notes:
            warnings.simplefilter("always", LegacyManifestWarning)
            ckpt = Checkpoint(argv[0])
    except ReaderError as e:
        print(f"corrupt: {e}", file=sys.stderr)
        return 1
    for note in notes:
        print(f"note: {note.message}", file=sys.stderr)
    seal = "manifest sealed" if ckpt.sealed else "manifest unsealed (format 1.0)"
    print(f"step {ckpt.step}: {len(ckpt.tensor_names())} tensors, checksums ok, {seal}")
    for name in ckpt.tensor_names():
        t = ckpt.manifest["tensors"][name]
        print(f"  {name} {t['dtype']} {t['shape']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
