"""Loading a checkpoint: all seven fields together, every byte checked by default.

Tensors are read straight into their final memory (``readinto`` the bytes of freshly
allocated tensors, chunk by chunk), and the CRC of each block is summed on a thread
while the next block is read, so verification costs little beyond the read itself.
"""

from __future__ import annotations

import json
import os
import warnings
import zlib
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoint import codec, crc, layout
from perdure.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from perdure.checkpoint.fsio import readinto_all
from perdure.checkpoint.manifest import read_manifest, split_checksum
from perdure.checkpoint.sfile import Header, read_header
from perdure.checkpoint.state import LoadedCheckpoint
from perdure.checkpoint.tensors import (
    ITEMSIZE,
    TORCH_DTYPES,
    byte_view,
    model_of,
    unflatten_optimizer,
)
from perdure.checkpoint.writer import checksum_pool


def load_checkpoint(
    path: str | Path, *, verify: bool = True, mmap: bool = True
) -> LoadedCheckpoint:
    """Read the checkpoint directory ``path``. With ``verify`` every file's CRC is checked;
    any problem raises :class:`CorruptCheckpointError` naming the file.

    With ``mmap`` (default) each tensor file is mapped privately (copy-on-write) and an
    unsplit tensor is a view of the mapping: no copy, and the CRC pass is the only read.
    The files of a committed checkpoint are never modified in place (retention deletes
    them, which keeps a mapped inode alive), so this is safe; a write to such a tensor
    copies the page. ``mmap=False`` reads into freshly allocated memory instead."""
    path = Path(path)
    manifest = read_manifest(path)
    check_files_present(path, manifest)
    ctx = read_context(path, manifest, verify=verify)
    reader = map_tensors if mmap else read_tensors
    tensors = reader(path, manifest, verify=verify)
    where = str(path / layout.CONTEXT)
    try:
        optimizer = unflatten_optimizer(ctx["optimizer"], tensors)
        return LoadedCheckpoint(
            step=int(ctx["step"]),
            model=model_of(tensors),
            optimizer=optimizer,
            rng=codec.decode(ctx["rng"]),
            data=codec.decode(ctx["data"]),
            config_hash=ctx["config_hash"],
            canonical_config=codec.decode(ctx["canonical_config"]),
            topology=codec.decode(ctx["topology"]),
            provenance=codec.decode(ctx["provenance"]),
            decisions=codec.decode(ctx["decisions"]),
            path=path,
            manifest=manifest,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise CorruptCheckpointError(where, f"context is incomplete or malformed ({e})") from None


def check_files_present(path: Path, manifest: dict[str, Any]) -> None:
    """Every listed file exists with its listed size (cheap: no data read)."""
    for name, rec in manifest["files"].items():
        try:
            size = os.stat(path / name).st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(
                str(path / name), "missing (listed in the manifest)"
            ) from None
        if size != rec["bytes"]:
            raise CorruptCheckpointError(
                str(path / name),
                f"size is {size} bytes, the manifest says {rec['bytes']} (truncated?)",
            )
    if manifest["context"] not in manifest["files"]:
        raise CorruptCheckpointError(str(path / layout.MANIFEST), "the context file is not listed")


def read_context(path: Path, manifest: dict[str, Any], *, verify: bool) -> dict[str, Any]:
    name = manifest["context"]
    where = str(path / name)
    data = (path / name).read_bytes()
    if verify:
        _check_crc(where, manifest["files"][name]["checksum"], zlib.crc32(data))
    try:
        ctx = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptCheckpointError(where, f"not valid JSON ({e})") from None
    if not isinstance(ctx, dict):
        raise CorruptCheckpointError(where, "not a JSON object")
    return ctx


def _check_crc(where: str, expected: str, got: int) -> None:
    _, want = split_checksum(expected, where)
    if crc.format_crc(got) != want:
        raise CorruptCheckpointError(
            where, f"checksum mismatch: manifest says crc32 {want}, file has {crc.format_crc(got)}"
        )


def read_tensors(path: Path, manifest: dict[str, Any], *, verify: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the manifest, in manifest order, chunks assembled."""
    tensors: dict[str, torch.Tensor] = {}
    by_file: dict[str, dict[str, tuple[str, int, int]]] = defaultdict(dict)
    mpath = str(path / layout.MANIFEST)
    for key, t in manifest["tensors"].items():
        try:
            full = torch.empty(tuple(t["shape"]), dtype=TORCH_DTYPES[t["dtype"]])
            for c in t["chunks"]:
                a, b = (0, 0) if c["rows"] is None else c["rows"]
                by_file[c["file"]][c["key"]] = (key, a, b)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(mpath, f"malformed tensor entry {key!r} ({e})") from None
        tensors[key] = full
    for name in sorted(by_file):
        if name not in manifest["files"]:
            raise CorruptCheckpointError(mpath, f"chunk file {name!r} is not listed in 'files'")
        _read_part(path / name, manifest["files"][name], by_file[name], tensors, verify)
    return tensors


def _chunk_index(
    path: Path, manifest: dict[str, Any]
) -> tuple[dict[str, tuple[Any, tuple[int, ...]]], dict[str, dict[str, tuple[str, int, int]]]]:
    """({tensor: (torch dtype, shape)}, {file: {chunk key: (tensor, start, stop)}})."""
    metas: dict[str, tuple[Any, tuple[int, ...]]] = {}
    by_file: dict[str, dict[str, tuple[str, int, int]]] = defaultdict(dict)
    mpath = str(path / layout.MANIFEST)
    for key, t in manifest["tensors"].items():
        try:
            metas[key] = (TORCH_DTYPES[t["dtype"]], tuple(int(d) for d in t["shape"]))
            for c in t["chunks"]:
                a, b = (0, 0) if c["rows"] is None else c["rows"]
                by_file[c["file"]][c["key"]] = (key, a, b)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(mpath, f"malformed tensor entry {key!r} ({e})") from None
    for name in by_file:
        if name not in manifest["files"]:
            raise CorruptCheckpointError(mpath, f"chunk file {name!r} is not listed in 'files'")
    return metas, by_file


def map_tensors(path: Path, manifest: dict[str, Any], *, verify: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the manifest as views of privately mapped files (see load)."""
    metas, by_file = _chunk_index(path, manifest)
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for name in sorted(by_file):
        for key, a, view in _map_part(
            path / name, manifest["files"][name], by_file[name], metas, verify
        ):
            pieces[key].append((a, view))
    tensors: dict[str, torch.Tensor] = {}
    for key, (dtype, shape) in metas.items():
        parts = sorted(pieces.get(key, []), key=lambda p: p[0])
        if len(parts) == 1 and tuple(parts[0][1].shape) == shape:
            tensors[key] = parts[0][1]
            continue
        full = torch.empty(shape, dtype=dtype)
        for a, view in parts:
            full[a : a + view.shape[0]].copy_(view)
        tensors[key] = full
    return tensors


def _map_part(
    file: Path,
    rec: dict[str, Any],
    chunks: dict[str, tuple[str, int, int]],
    metas: dict[str, tuple[Any, tuple[int, ...]]],
    verify: bool,
) -> list[tuple[str, int, torch.Tensor]]:
    where, size = str(file), rec["bytes"]
    with open(file, "rb") as f:
        header = read_header(f, where, size)  # type: ignore[arg-type]
    _check_entries(where, header, chunks, metas)
    storage = torch.UntypedStorage.from_file(str(file), shared=False, nbytes=size)
    u8 = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
    if verify:
        got = crc.crc_segments([byte_view(u8)], checksum_pool())
        _check_crc(where, rec["checksum"], got)
    out = []
    for e in header.entries.values():
        key, a, _ = chunks[e.key]
        dtype = metas[key][0]
        raw = u8[header.data_start + e.begin : header.data_start + e.end]
        item = ITEMSIZE[e.dtype]
        if (header.data_start + e.begin) % item:
            raw = raw.clone()  # a file from another writer, not aligned: copy
        out.append((key, a, raw.view(dtype).reshape(e.shape)))
    return out


def _check_entries(
    where: str,
    header: Header,
    chunks: dict[str, tuple[str, int, int]],
    metas: dict[str, tuple[Any, tuple[int, ...]]],
) -> None:
    missing = sorted(set(chunks) - set(header.entries))
    extra = sorted(set(header.entries) - set(chunks))
    if missing or extra:
        raise CorruptCheckpointError(
            where, f"header and manifest disagree: missing {missing[:5]}, unlisted {extra[:5]}"
        )
    for e in header.entries.values():
        key, a, b = chunks[e.key]
        dtype, shape = metas[key]
        want = shape if not shape else (b - a, *shape[1:])
        if TORCH_DTYPES.get(e.dtype) != dtype or e.shape != want:
            raise CorruptCheckpointError(
                where,
                f"{e.key!r} is {e.dtype} {list(e.shape)}, the manifest says {dtype} {list(want)}",
            )


def _read_part(
    file: Path,
    rec: dict[str, Any],
    chunks: dict[str, tuple[str, int, int]],
    tensors: dict[str, torch.Tensor],
    verify: bool,
) -> None:
    where = str(file)
    size = rec["bytes"]
    with open(file, "rb", buffering=0) as f:
        header = read_header(f, where, size)  # type: ignore[arg-type]
        dests = _destinations(where, header, chunks, tensors)
        pool = checksum_pool()
        futures = []
        for block in crc.blocks(dests):
            for mv in block:
                readinto_all(f, mv, where)  # type: ignore[arg-type]
            if verify:
                futures.append(pool.submit(crc.crc_block, block))
        if f.read(1):
            raise CorruptCheckpointError(where, "the file is longer than its data")
    if verify:
        data_crc = crc.join_futures(futures)
        got = crc.crc32_combine(zlib.crc32(header.prefix), data_crc, size - len(header.prefix))
        _check_crc(where, rec["checksum"], got)


def _destinations(
    where: str,
    header: Header,
    chunks: dict[str, tuple[str, int, int]],
    tensors: dict[str, torch.Tensor],
) -> list[memoryview]:
    """Memory that each stored chunk is read into, in the file's data order."""
    missing = sorted(set(chunks) - set(header.entries))
    extra = sorted(set(header.entries) - set(chunks))
    if missing or extra:
        raise CorruptCheckpointError(
            where, f"header and manifest disagree: missing {missing[:5]}, unlisted {extra[:5]}"
        )
    out = []
    for e in header.entries.values():
        key, a, b = chunks[e.key]
        full = tensors[key]
        want = tuple(full.shape) if not full.shape else (b - a, *full.shape[1:])
        if TORCH_DTYPES.get(e.dtype) != full.dtype or e.shape != want:
            raise CorruptCheckpointError(
                where,
                f"{e.key!r} is {e.dtype} {list(e.shape)}, "
                f"the manifest says {full.dtype} {list(want)}",
            )
        view = byte_view(full)
        rb = len(view) // full.shape[0] if full.shape and full.shape[0] else 0
        out.append(view[a * rb : b * rb] if full.shape else view)
    return out


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Check a checkpoint without keeping its tensors: manifest, presence, sizes, headers,
    every checksum. Returns the manifest; raises naming the first bad file."""
    path = Path(path)
    manifest = read_manifest(path)
    check_files_present(path, manifest)
    read_context(path, manifest, verify=True)
    read_tensors(path, manifest, verify=True)
    return manifest


def check_compatible(
    loaded: LoadedCheckpoint,
    config_hash: str,
    canonical: dict[str, Any],
    *,
    allow_config_change: bool = False,
    provenance: dict[str, Any] | None = None,
) -> list[str]:
    """Refuse a checkpoint written under another config hash, naming both hashes and the
    differing canonical keys; with ``allow_config_change`` return those keys instead (the
    caller records the override with :func:`config_override_entry`). Returns ``[]`` when
    the hashes match. A different commit sha (given ``provenance``) only warns."""
    if provenance is not None:
        old, new = loaded.provenance.get("sha"), provenance.get("sha")
        if old != new:
            warnings.warn(
                f"{loaded.path}: written by commit {old}, this run is at commit {new}",
                stacklevel=2,
            )
    if loaded.config_hash == config_hash:
        return []
    from perdure.config.diff import diff_canonical

    keys = diff_canonical(loaded.canonical_config, canonical)
    if not allow_config_change:
        raise IncompatibleCheckpointError(
            f"{loaded.path}: written under config hash {loaded.config_hash}, this run's is "
            f"{config_hash}; differing keys: {', '.join(keys) or '(none in canonical config)'}. "
            "Pass allow_config_change to resume anyway (the override is recorded)."
        )
    return keys or ["<canonical config equal; hash differs>"]


def config_override_entry(
    loaded: LoadedCheckpoint, config_hash: str, keys: list[str]
) -> dict[str, Any]:
    """The decision-log entry that records a forced config change at resume."""
    return {
        "step": loaded.step,
        "kind": "config_override",
        "details": {
            "from": loaded.config_hash,
            "to": config_hash,
            "keys": keys,
            "checkpoint": str(loaded.path),
        },
    }
