"""Loading a checkpoint: all seven fields together, every byte checked by default.

Tensors are read straight into their final memory (``readinto`` the bytes of freshly
allocated tensors, chunk by chunk), and the CRC of each block is summed on a thread
while the next block is read, so verification costs little beyond the read itself.
"""

from __future__ import annotations

import os
import stat
import warnings
import zlib
from collections import defaultdict
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoint import codec, crc, layout, rules
from perdure.checkpoint.crc import checksum_pool
from perdure.checkpoint.errors import CorruptCheckpointError, IncompatibleCheckpointError
from perdure.checkpoint.fsio import readinto_all
from perdure.checkpoint.manifest import read_manifest, split_checksum
from perdure.checkpoint.rules import ChunkSpec, TensorSpec
from perdure.checkpoint.sfile import Entry, Header, read_header
from perdure.checkpoint.state import LoadedCheckpoint
from perdure.checkpoint.tensors import (
    ITEMSIZE,
    TORCH_DTYPES,
    byte_view,
    model_of,
    unflatten_optimizer,
)


def load_checkpoint(
    path: str | Path, *, verify: bool = True, mmap: bool = True
) -> LoadedCheckpoint:
    """Read the checkpoint directory ``path``. With ``verify`` every file's CRC is checked;
    any problem raises :class:`CorruptCheckpointError` naming the file and the rule.

    Every structural rule of the spec (manifest, headers, context) is checked before a
    tensor is allocated, so a manifest that lies about rows, keys, dtypes or shapes is
    refused, never read into different state.

    With ``mmap`` (default) each tensor file is mapped privately (copy-on-write) and an
    unsplit tensor is a view of the mapping: no copy, and the CRC pass is the only read.
    The files of a committed checkpoint are never modified in place (retention deletes
    them, which keeps a mapped inode alive), so this is safe; a write to such a tensor
    copies the page. ``mmap=False`` reads into freshly allocated memory instead."""
    index = open_index(Path(path))
    ctx = read_context(index.path, index.manifest, verify=verify)
    reader = map_tensors if mmap else read_tensors
    tensors = reader(index, verify=verify)
    fields = context_fields(ctx, tensors, str(index.path / index.manifest["context"]))
    return LoadedCheckpoint(
        model=model_of(tensors), path=index.path, manifest=index.manifest, **fields
    )


def context_fields(ctx: dict[str, Any], tensors: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The context's fields decoded from tagged JSON, optimizer tensors put in place;
    each must decode to its type (a tag cannot turn the optimizer state into a tuple)."""
    try:
        fields = {
            "step": ctx["step"],
            "optimizer": unflatten_optimizer(ctx["optimizer"], tensors),
            "rng": codec.decode(ctx["rng"]),
            "data": codec.decode(ctx["data"]),
            "config_hash": ctx["config_hash"],
            "canonical_config": codec.decode(ctx["canonical_config"]),
            "topology": codec.decode(ctx["topology"]),
            "provenance": codec.decode(ctx["provenance"]),
            "decisions": codec.decode(ctx["decisions"]),
        }
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise CorruptCheckpointError(where, f"context is incomplete or malformed ({e})") from None
    for key, tp in rules.CONTEXT_FIELDS.items():
        if not isinstance(fields[key], tp):
            raise CorruptCheckpointError(where, f"field {key!r} decodes to a non-{tp.__name__}")
    return fields


@dataclass(frozen=True)
class Index:
    """A checkpoint whose manifest, file sizes and safetensors headers obey every rule:
    what remains to read is bytes, each chunk's exactly as long as its place."""

    path: Path
    manifest: dict[str, Any]
    specs: dict[str, TensorSpec]
    headers: dict[str, Header]
    """Tensor file name -> its checked header."""
    held: rules.Placements

    def chunks(self, name: str) -> list[tuple[Entry, TensorSpec, ChunkSpec]]:
        """The chunks of tensor file ``name`` in the file's data order."""
        held = self.held[name]
        return [(e, *held[e.key]) for e in self.headers[name].entries.values()]


def open_index(path: Path) -> Index:
    """Manifest, presence and size of every file, and each tensor file's header checked
    against the manifest (cheap: headers only, no tensor data read or allocated)."""
    manifest = read_manifest(path)
    specs = rules.tensor_specs(manifest, str(path / layout.MANIFEST))
    check_files_present(path, manifest)
    held = rules.placements(specs)
    headers = {}
    for name in sorted(held):
        where = str(path / name)
        with _io(where), open(path / name, "rb") as f:
            header = read_header(f, where, manifest["files"][name]["bytes"])  # type: ignore[arg-type]
        rules.check_header(where, header.entries, held[name])
        headers[name] = header
    return Index(path, manifest, specs, headers, held)


@contextmanager
def _io(where: str) -> Iterator[None]:
    """An OS error on a listed file is the format's error naming it, not a traceback."""
    try:
        yield
    except FileNotFoundError:
        raise CorruptCheckpointError(where, "missing (listed in the manifest)") from None
    except OSError as e:
        raise CorruptCheckpointError(where, f"unreadable ({e.strerror or e})") from None


def check_files_present(path: Path, manifest: dict[str, Any]) -> None:
    """Every listed file is a regular file with its listed size (cheap: no data read)."""
    for name, rec in manifest["files"].items():
        where = str(path / name)
        with _io(where):
            st = os.stat(path / name)
        if not stat.S_ISREG(st.st_mode):
            raise CorruptCheckpointError(where, "not a regular file")
        if st.st_size != rec["bytes"]:
            raise CorruptCheckpointError(
                where, f"size is {st.st_size} bytes, the manifest says {rec['bytes']} (truncated?)"
            )


def read_context(path: Path, manifest: dict[str, Any], *, verify: bool) -> dict[str, Any]:
    """The context file, checked: its CRC (with ``verify``), UTF-8 JSON, an object with
    every field, the manifest's step and exactly the manifest's optimizer tensors."""
    name = manifest["context"]
    where = str(path / name)
    with _io(where):
        data = (path / name).read_bytes()
    if len(data) != manifest["files"][name]["bytes"]:
        raise CorruptCheckpointError(where, "changed size while being read")
    if verify:
        _check_crc(where, manifest["files"][name]["checksum"], zlib.crc32(data))
    ctx = codec.loads_strict(data, where)
    if not isinstance(ctx, dict):
        raise CorruptCheckpointError(where, "not a JSON object")
    specs = rules.tensor_specs(manifest, str(path / layout.MANIFEST))
    rules.check_context(ctx, manifest["step"], specs, where)
    return ctx


def _check_crc(where: str, expected: str, got: int) -> None:
    _, want = split_checksum(expected, where)
    if crc.format_crc(got) != want:
        raise CorruptCheckpointError(
            where, f"checksum mismatch: manifest says crc32 {want}, file has {crc.format_crc(got)}"
        )


def read_tensors(index: Index, *, verify: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the manifest, in manifest order, chunks read into place. Safe to
    allocate: the index proved every row covered once by bytes that exist on disk."""
    tensors = {k: torch.empty(s.shape, dtype=TORCH_DTYPES[s.dtype]) for k, s in index.specs.items()}
    for name in index.headers:
        _read_part(index, name, tensors, verify)
    return tensors


def map_tensors(index: Index, *, verify: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the manifest as views of privately mapped files (see load)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = defaultdict(list)
    for name in index.headers:
        for key, a, view in _map_part(index, name, verify):
            pieces[key].append((a, view))
    tensors: dict[str, torch.Tensor] = {}
    for key, spec in index.specs.items():
        parts = sorted(pieces[key], key=lambda p: p[0])
        if len(parts) == 1:
            tensors[key] = parts[0][1]
            continue
        full = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype])
        for a, view in parts:
            full[a : a + view.shape[0]].copy_(view)
        tensors[key] = full
    return tensors


def _map_part(index: Index, name: str, verify: bool) -> list[tuple[str, int, torch.Tensor]]:
    where, rec = str(index.path / name), index.manifest["files"][name]
    header = index.headers[name]
    with _io(where):
        storage = torch.UntypedStorage.from_file(where, shared=False, nbytes=rec["bytes"])
    u8 = torch.empty(0, dtype=torch.uint8).set_(storage)  # type: ignore[arg-type]
    if verify:
        got = crc.crc_segments([byte_view(u8)], checksum_pool())
        _check_crc(where, rec["checksum"], got)
    out = []
    for e, spec, c in index.chunks(name):
        raw = u8[header.data_start + e.begin : header.data_start + e.end]
        if (header.data_start + e.begin) % ITEMSIZE[e.dtype]:
            raw = raw.clone()  # a file from another writer, not aligned: copy
        out.append((spec.name, c.start, raw.view(TORCH_DTYPES[e.dtype]).reshape(e.shape)))
    return out


def _read_part(index: Index, name: str, tensors: dict[str, torch.Tensor], verify: bool) -> None:
    where, rec = str(index.path / name), index.manifest["files"][name]
    header = index.headers[name]
    dests = [_destination(tensors[spec.name], c) for _, spec, c in index.chunks(name)]
    pool = checksum_pool()
    futures = []
    with _io(where), open(index.path / name, "rb", buffering=0) as f:
        f.seek(header.data_start)
        for block in crc.blocks(dests):
            for mv in block:
                readinto_all(f, mv, where)  # type: ignore[arg-type]
            if verify:
                futures.append(pool.submit(crc.crc_block, block))
        if f.read(1):
            raise CorruptCheckpointError(where, "the file is longer than its data")
    if verify:
        data_crc = crc.join_futures(futures)
        size = rec["bytes"]
        got = crc.crc32_combine(zlib.crc32(header.prefix), data_crc, size - len(header.prefix))
        _check_crc(where, rec["checksum"], got)


def _destination(full: torch.Tensor, c: ChunkSpec) -> memoryview:
    """The memory that chunk ``c`` of tensor ``full`` is read into."""
    view = byte_view(full)
    if not full.shape:
        return view
    rb = len(view) // full.shape[0] if full.shape[0] else 0
    return view[c.start * rb : c.stop * rb]


def verify_checkpoint(path: str | Path, *, checksums: bool = True) -> dict[str, Any]:
    """Check a checkpoint without keeping its tensors: every rule the loader checks
    (manifest, presence, sizes, headers, context) and, with ``checksums``, every file's
    CRC, so that a checkpoint this accepts loads into exactly the state it describes.
    Returns the manifest; raises naming the first bad file."""
    index = open_index(Path(path))
    ctx = read_context(index.path, index.manifest, verify=checksums)
    context_fields(ctx, dict.fromkeys(index.specs), str(index.path / index.manifest["context"]))
    if checksums:
        for name in index.headers:
            _check_file_crc(index.path / name, index.manifest["files"][name])
    return index.manifest


def _check_file_crc(file: Path, rec: dict[str, Any]) -> None:
    """Stream a file through CRC-32 in bounded blocks (nothing kept)."""
    where, value, size = str(file), 0, 0
    buf = bytearray(min(crc.BLOCK, max(rec["bytes"], 1)))
    with _io(where), open(file, "rb", buffering=0) as f:
        while n := f.readinto(buf):  # type: ignore[attr-defined]
            value = zlib.crc32(memoryview(buf)[:n], value)
            size += n
    if size != rec["bytes"]:
        raise CorruptCheckpointError(where, "changed size while being read")
    _check_crc(where, rec["checksum"], value)


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
    if loaded.config_hash == config_hash or _legacy_match(loaded, canonical):
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


def _legacy_match(loaded: LoadedCheckpoint, canonical: dict[str, Any]) -> bool:
    """A checkpoint written before the run's identity (dataset version, recipe) was part of
    the hash matches on the config alone, with a warning that the identity went unchecked."""
    from perdure.config.digest import hash_canonical

    if "identity" in loaded.canonical_config or "identity" not in canonical:
        return False
    bare = {k: v for k, v in canonical.items() if k != "identity"}
    if loaded.config_hash != hash_canonical(bare):
        return False
    warnings.warn(
        f"{loaded.path}: written before the run's identity (dataset version, optimizer, "
        "scheduler) was recorded: only the config file's settings were compared",
        stacklevel=3,
    )
    return True


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
