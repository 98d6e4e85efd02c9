"""A checkpoint opened without its tensors: each tensor read later, alone, by byte range.

A rank whose parameters and optimizer state are sharded (``train.shard_params``) needs
the tensors of its own shard only, and it learns which shard is its own after it has
loaded (when an epoch starts). :func:`open_lazy` therefore checks every structural rule
(manifest, sizes, headers, context: :func:`loader.open_index`) and returns the seven
fields with every tensor a ``meta`` tensor of its dtype and shape; a :class:`RangeReader`
then reads any tensor on demand, straight into its destination, from exactly its chunks'
byte ranges (the safetensors header gives each chunk's offsets; a chunk split across
writers' files is read from each), on threads, with positional reads (``os.pread``), so
that a checkpoint written at any (W, k) loads at any (W', k') and no rank ever holds, or
reads, more than the tensors it asks for.

What it does not do: check the files' CRC-32. A file's checksum covers the whole file, and
a rank reads a fraction of it. A checkpoint a run loads has been verified whole once
before (``latest_checkpoint`` on the coordinator, every file streamed through the CRC in
bounded blocks; the launcher's preflight for an explicit ``--resume``); the context file,
small, is checked here. Checkpoints are local paths (``checkpoint.dir``), so the reads
are ``pread`` on local or mounted files; an fsspec URL is not a checkpoint location.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from perdure.checkpoint.errors import CorruptCheckpointError
from perdure.checkpoint.loader import Index, _io, context_fields, open_index, read_context
from perdure.checkpoint.state import LoadedCheckpoint
from perdure.checkpoint.tensors import TORCH_DTYPES, Meta, byte_view, model_of

READERS = 8
"""Threads reading ranges at once (``pread`` releases the GIL)."""


@dataclass(frozen=True)
class Piece:
    """Bytes ``[begin, end)`` of file ``name`` hold bytes ``[at, at + end - begin)`` of
    the tensor."""

    name: str
    begin: int
    end: int
    at: int


class RangeReader:
    """Reads single tensors of a checked checkpoint by byte range (see module doc)."""

    def __init__(self, index: Index) -> None:
        self.index = index
        self.pieces: dict[str, list[Piece]] = {}
        for name, header in index.headers.items():
            for e, spec, c in index.chunks(name):
                at = c.start * Meta(spec.name, spec.dtype, spec.shape).row_bytes
                begin = header.data_start + e.begin
                piece = Piece(name, begin, header.data_start + e.end, at)
                self.pieces.setdefault(spec.name, []).append(piece)
        self._lock = threading.Lock()
        self._fds: dict[str, int] = {}
        self.bytes_read = 0
        """Tensor bytes read so far (what a test or a benchmark compares with the whole)."""

    def nbytes(self, key: str) -> int:
        spec = self.index.specs[key]
        return Meta(key, spec.dtype, spec.shape).nbytes

    def _fd(self, name: str) -> int:
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                with _io(str(self.index.path / name)):
                    fd = os.open(self.index.path / name, os.O_RDONLY)
                self._fds[name] = fd
            return fd

    def read_into(self, key: str, dest: torch.Tensor) -> None:
        """Fill ``dest`` (a contiguous CPU tensor of the key's dtype and shape) with the
        tensor ``key``'s bytes."""
        spec = self.index.specs[key]
        if tuple(dest.shape) != spec.shape or dest.dtype != TORCH_DTYPES[spec.dtype]:
            raise ValueError(f"{key}: is {spec.dtype} {list(spec.shape)}, the destination "
                             f"{dest.dtype} {list(dest.shape)}")  # fmt: skip
        view = byte_view(dest)
        for p in self.pieces[key]:
            self._pread(p, view[p.at : p.at + p.end - p.begin])
        with self._lock:
            self.bytes_read += len(view)

    def _pread(self, p: Piece, mv: memoryview) -> None:
        where, fd, pos = str(self.index.path / p.name), self._fd(p.name), p.begin
        while len(mv):
            with _io(where):
                n = os.preadv(fd, [mv[: 64 << 20]], pos)
            if n <= 0:
                raise CorruptCheckpointError(where, "truncated: the file ends before its data")
            mv, pos = mv[n:], pos + n

    def read(self, key: str) -> torch.Tensor:
        spec = self.index.specs[key]
        out = torch.empty(spec.shape, dtype=TORCH_DTYPES[spec.dtype])
        self.read_into(key, out)
        return out

    def read_many(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """Several tensors, read in parallel."""
        keys = list(keys)
        with ThreadPoolExecutor(min(READERS, max(1, len(keys)))) as pool:
            return dict(zip(keys, pool.map(self.read, keys), strict=True))

    def fill(self, pairs: Sequence[tuple[str, torch.Tensor]]) -> None:
        """``read_into`` for each ``(key, destination)``, in parallel."""
        with ThreadPoolExecutor(min(READERS, max(1, len(pairs)))) as pool:
            list(pool.map(lambda kd: self.read_into(*kd), pairs))

    def close(self) -> None:
        with self._lock:
            fds, self._fds = list(self._fds.values()), {}
        for fd in fds:
            os.close(fd)


class Lazy:
    """A checkpoint's fields with ``meta`` stand-ins for its tensors, and their reader."""

    def __init__(self, loaded: LoadedCheckpoint, reader: RangeReader,
                 keys: dict[int, str]) -> None:  # fmt: skip
        self.loaded = loaded
        self.reader = reader
        self.keys = keys
        """id of each stand-in -> the stored tensor's key."""

    def key_of(self, t: torch.Tensor) -> str | None:
        return self.keys.get(id(t)) if t.device.type == "meta" else None

    def resolve(self, value: Any) -> Any:
        """``value`` (an optimizer state or part of one) with every stand-in read; the
        stand-ins of one call are read in parallel. Other values are kept as they are."""
        wanted: list[str] = []
        _walk(value, lambda t: wanted.append(k) if (k := self.key_of(t)) else None)
        got = self.reader.read_many(dict.fromkeys(wanted))
        return _replace(value, lambda t: got[k] if (k := self.key_of(t)) else t)


def _walk(value: Any, fn: Any) -> None:
    if isinstance(value, torch.Tensor):
        fn(value)
    elif isinstance(value, dict):
        for v in value.values():
            _walk(v, fn)
    elif isinstance(value, (list, tuple)):
        for v in value:
            _walk(v, fn)


def _replace(value: Any, fn: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, dict):
        return {k: _replace(v, fn) for k, v in value.items()}
    if isinstance(value, list):
        return [_replace(v, fn) for v in value]
    if isinstance(value, tuple):
        return tuple(_replace(v, fn) for v in value)
    return value


def open_lazy(path: str | Path) -> Lazy:
    """Every rule checked, the context read (its CRC checked), no tensor data read."""
    index = open_index(Path(path))
    ctx = read_context(index.path, index.manifest, verify=True)
    stand_ins = {
        k: torch.empty(s.shape, dtype=TORCH_DTYPES[s.dtype], device="meta")
        for k, s in index.specs.items()
    }
    fields = context_fields(ctx, stand_ins, str(index.path / index.manifest["context"]))
    loaded = LoadedCheckpoint(
        model=model_of(stand_ins), path=index.path, manifest=index.manifest, **fields
    )
    return Lazy(loaded, RangeReader(index), {id(t): k for k, t in stand_ins.items()})
