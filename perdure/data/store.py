"""Where shard bytes come from: local files mapped in place, or remote files cached locally.

- **Local** (a plain path or ``file://``): the shard file is memory-mapped where it lies:
  zero copy, no cache, the OS page cache does the caching.
- **Remote** (any other fsspec protocol: ``memory://``, ``http(s)://``, ``s3://``, ...): a
  shard is downloaded whole, the first time a read needs it, into
  ``cache_dir/<version id>/<file>`` (temporary name, then rename, so a reader never sees a
  partial file), then memory-mapped. The cache holds at most ``cache_mb``; the least
  recently used shards are evicted first (deleted). One shard larger than the bound is
  still served: the bound is exceeded by at most the shard being read.

Each shard's SHA-256 is checked the first time this process reads it (a download is
hashed while it streams). A shard that fails is remembered as bad and raises
:class:`~perdure.data.errors.ShardError` on every later read, without re-reading it.

Limits: one lock serialises shard fetches (a background prefetch and a foreground read of
another shard wait on each other during a download); the LRU bound is per process, so
workers sharing one ``cache_dir`` may together exceed it (give each worker its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import mmap
import os
import shutil
import tempfile
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import fsspec
import numpy as np

from perdure.data.errors import ShardError
from perdure.data.manifest import Manifest

CHUNK = 4 << 20


def is_local(protocol: str | tuple[str, ...]) -> bool:
    protos = (protocol,) if isinstance(protocol, str) else protocol
    return any(p in ("file", "local") for p in protos)


class ShardStore:
    """Verified, memory-mapped access to the shards of one dataset (thread safe)."""

    def __init__(
        self,
        fs: Any,
        root: str,
        manifest: Manifest,
        *,
        cache_dir: str | None,
        cache_mb: float,
    ) -> None:
        self.fs, self.root, self.manifest = fs, root.rstrip("/"), manifest
        self.local = is_local(fs.protocol)
        self.cache_bytes = int(cache_mb * (1 << 20))
        self._owned_tmp: str | None = None
        self.cache_root = None if self.local else self._cache_root(cache_dir)
        self._lock = threading.Lock()
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self._verified: set[int] = set()
        self._bad: dict[int, str] = {}
        self.downloads = 0
        self.evictions = 0

    def _cache_root(self, cache_dir: str | None) -> Path:
        if cache_dir is None:
            self._owned_tmp = tempfile.mkdtemp(prefix="perdure-shards-")
            cache_dir = self._owned_tmp
        root = Path(cache_dir) / self.manifest.version_id.removeprefix("sha256:")[:16]
        root.mkdir(parents=True, exist_ok=True)
        return root

    def url(self, shard: int) -> str:
        info = self.manifest.shards[shard]
        return info.source.url if info.source is not None else f"{self.root}/{info.file}"

    def rows(self, shard: int) -> np.ndarray:
        """The shard as a read-only array, ``[samples, seq_len + 1]`` tokens (a tokens-only
        dataset) or ``[samples]`` records of every field; raises ShardError."""
        if self.local:  # nothing is ever evicted: a plain dict read is safe without the lock
            arr = self._maps.get(shard)
            if arr is not None:
                return arr
        with self._lock:
            if shard in self._bad:
                raise ShardError(shard, self.url(shard), self._bad[shard])
            arr = self._maps.get(shard)
            if arr is not None:
                self._maps.move_to_end(shard)
                return arr
            try:
                arr = self._open(shard)
            except ShardError as e:
                self._bad[shard] = e.reason
                raise
            self._maps[shard] = arr
            self._evict()
            return arr

    def bad_shards(self) -> dict[int, str]:
        with self._lock:
            return dict(self._bad)

    def cached_bytes(self) -> int:
        return sum(a.nbytes for a in self._maps.values()) if not self.local else 0

    def _open(self, shard: int) -> np.ndarray:
        info = self.manifest.shards[shard]
        if info.source is not None:
            return self._open_in_place(shard)
        path = self.root + "/" + info.file if self.local else self._fetch(shard)
        path = path.removeprefix("file://")
        m = self.manifest
        dtype, shape = (m.record_dtype(), (info.samples,)) if m.extra_fields else (
            m.np_dtype(), (info.samples, m.seq_len + 1))  # fmt: skip
        try:
            arr = _map(path, dtype, shape)
        except (OSError, ValueError) as e:
            raise ShardError(shard, self.url(shard), f"cannot be mapped ({e})") from None
        if shard not in self._verified:
            digest = hashlib.sha256(arr.data).hexdigest()
            if digest != info.sha256:
                raise ShardError(shard, self.url(shard),
                                 f"checksum mismatch (manifest {info.sha256[:12]}..., "
                                 f"file {digest[:12]}...)")  # fmt: skip
            self._verified.add(shard)
        return arr

    def _open_in_place(self, shard: int) -> np.ndarray:
        """An in-place shard: its source file where it lies (a remote one fetched whole into
        the cache), checked whole against the size and SHA-256 recorded at import, so a
        file changed since is refused with its name."""
        info = self.manifest.shards[shard]
        src = info.source
        assert src is not None
        fs, path = open_fs(src.url)
        if not is_local(fs.protocol):
            if self.cache_root is None:
                self.cache_root = self._cache_root(None)
            path = self._fetch(shard, fs, src.url)
        m = self.manifest
        try:
            whole = _map(path.removeprefix("file://"), np.dtype(np.uint8), (src.size,))
        except FileNotFoundError:
            raise ShardError(shard, src.url, "missing (imported in place from there)") from None
        except (OSError, ValueError) as e:
            raise ShardError(
                shard, src.url, f"changed since it was imported in place ({e})"
            ) from None
        if shard not in self._verified:
            digest = hashlib.sha256(whole.data).hexdigest()
            if digest != info.sha256:
                why = f"SHA-256 {digest[:12]}..., recorded {info.sha256[:12]}..."
                raise ShardError(shard, src.url, f"changed since it was imported in place ({why})")
            self._verified.add(shard)
        rows = whole[src.offset : src.offset + info.bytes]
        return rows.view(m.np_dtype()).reshape(info.samples, m.seq_len + 1)

    def _fetch(self, shard: int, fs: Any = None, url: str | None = None) -> str:
        assert self.cache_root is not None
        info = self.manifest.shards[shard]
        dest = self.cache_root / info.file
        want = info.source.size if info.source is not None else info.bytes
        if dest.exists() and dest.stat().st_size == want:
            return str(dest)
        src_fs, src_url = (self.fs, self.url(shard)) if fs is None else (fs, url)
        fd, tmp = tempfile.mkstemp(prefix=f".{info.file}.", dir=self.cache_root)
        try:
            with os.fdopen(fd, "wb") as out, src_fs.open(src_url, "rb") as src:
                shutil.copyfileobj(src, out, CHUNK)
            os.replace(tmp, dest)
        except FileNotFoundError:
            raise ShardError(shard, self.url(shard), "missing") from None
        except OSError as e:
            raise ShardError(shard, self.url(shard), f"cannot be read ({e})") from None
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        self.downloads += 1
        self._verified.discard(shard)
        return str(dest)

    def _evict(self) -> None:
        if self.local:
            return
        while len(self._maps) > 1 and self.cached_bytes() > self.cache_bytes:
            shard, _ = self._maps.popitem(last=False)
            assert self.cache_root is not None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cache_root / self.manifest.shards[shard].file)
            self._verified.discard(shard)
            self.evictions += 1

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
            if self._owned_tmp is not None:
                shutil.rmtree(self._owned_tmp, ignore_errors=True)
                self._owned_tmp = None


def _map(path: str, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """Read-only zero-copy array over a file: a plain ndarray on an ``mmap`` (not
    ``np.memmap``, whose subclass hooks cost microseconds on every indexing)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        expected = math.prod(shape) * dtype.itemsize
        if size != expected:
            raise ValueError(f"size {size} bytes, expected {expected}")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(buf, dtype=dtype).reshape(shape)


def open_fs(url: str) -> tuple[Any, str]:
    """fsspec file system and root path of a dataset URL (a plain path is local)."""
    fs, path = fsspec.core.url_to_fs(url)
    return fs, path
