"""Where part bytes come from: local files mapped in place, or remote files cached locally.

- **Local** (a plain path or ``file://``): the part file is memory-mapped where it lies:
  zero copy, no cache, the OS page cache does the caching.
- **Remote** (any other fsspec protocol: ``memory://``, ``http(s)://``, ``s3://``, ...): a
  part is downloaded whole, the first time a read needs it, into
  ``cache_dir/<version id>/<file>`` (temporary name, then rename, so a reader never sees a
  partial file), then memory-mapped. The cache holds at most ``cache_mb``; the least
  recently used parts are evicted first (deleted). One part larger than the bound is
  still served: the bound is exceeded by at most the part being read.

Each part's SHA-256 is checked the first time this process reads it. Remote requests
are tried again with backoff and a deadline each (:mod:`perdure.data.retry`). A part that
fails (checksum, unreadable, missing) is a storage fault, handled in this order:

1. read again once (a transient fault: a bad read, a torn download);
2. fetched from each of ``mirrors`` in turn (``data.mirrors``: copies of the dataset),
   into the cache, and served only if it matches the manifest's SHA-256;
3. otherwise remembered as bad: it raises :class:`~perdure.data.errors.PartError` on
   every later read without being read again, and the loader applies ``data.on_corrupt``.

Each success of 1 or 2 is a record in :meth:`PartStore.take_repairs` (the worker writes
them as ``part_repaired`` events). A repaired part holds the manifest's bytes, so the
run's math does not change.

Limits: a part is fetched by one thread at a time (a per-part lock; a download of one
part does not hold up reads of others); the LRU bound is per process, so workers sharing
one ``cache_dir`` may together exceed it (give each worker its own); a part imported in
place (``source``) is read again but has no mirror copy; a part whose bytes change on
disk after this process verified and mapped it is not checked again (verify-once).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
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

from perdure.data.errors import PartError
from perdure.data.manifest import Manifest, PartInfo
from perdure.data.retry import ReadFailed, ReadPolicy, is_http, storage_options, with_retries

log = logging.getLogger("perdure.data")

CHUNK = 4 << 20


def is_local(protocol: str | tuple[str, ...]) -> bool:
    protos = (protocol,) if isinstance(protocol, str) else protocol
    return any(p in ("file", "local") for p in protos)


class PartStore:
    """Verified, memory-mapped access to the parts of one dataset (thread safe)."""

    def __init__(
        self,
        fs: Any,
        root: str,
        manifest: Manifest,
        *,
        cache_dir: str | None,
        cache_mb: float,
        mirrors: tuple[str, ...] = (),
        policy: ReadPolicy | None = None,
    ) -> None:
        self.fs, self.root, self.manifest = fs, root.rstrip("/"), manifest
        self.local = is_local(fs.protocol)
        self.cache_bytes = int(cache_mb * (1 << 20))
        self.mirrors = tuple(m.rstrip("/") for m in mirrors)
        self.policy = policy or ReadPolicy()
        self._cache_dir = cache_dir
        self._owned_tmp: str | None = None
        self.cache_root = None if self.local else self._cache_root(cache_dir)
        self._lock = threading.Lock()
        self._part_locks: dict[int, threading.Lock] = {}
        self._maps: OrderedDict[int, np.ndarray] = OrderedDict()
        self._verified: set[int] = set()
        self._bad: dict[int, PartError] = {}
        self._from_mirror: dict[int, str] = {}  # part -> its repaired file in the cache
        self._injected: set[int] = set()  # chaos: parts whose primary copy reads corrupt
        self._repairs: list[dict[str, Any]] = []
        self.downloads = 0
        self.evictions = 0
        self.retries = [0]
        """Remote requests tried again (one counter, shared with ``with_retries``)."""

    def _cache_root(self, cache_dir: str | None) -> Path:
        if cache_dir is None:
            self._owned_tmp = tempfile.mkdtemp(prefix="perdure-parts-")
            cache_dir = self._owned_tmp
        root = Path(cache_dir) / self.manifest.version_id.removeprefix("sha256:")[:16]
        root.mkdir(parents=True, exist_ok=True)
        return root

    def url(self, part: int) -> str:
        info = self.manifest.parts[part]
        return info.source.url if info.source is not None else f"{self.root}/{info.file}"

    def rows(self, part: int) -> np.ndarray:
        """The part as a read-only array, ``[samples, seq_len + 1]`` tokens (a tokens-only
        dataset) or ``[samples]`` records of every field; raises PartError."""
        if self.local:  # nothing is ever evicted: a plain dict read is safe without the lock
            arr = self._maps.get(part)
            if arr is not None:
                return arr
        hit = self._cached(part)
        if hit is not None:
            return hit
        with self._part_lock(part):  # one fetch of a part at a time, others go on
            hit = self._cached(part)
            if hit is not None:
                return hit
            try:
                arr = self._recover(part)
            except PartError as e:
                with self._lock:
                    self._bad[part] = e
                raise
            with self._lock:
                self._maps[part] = arr
                self._evict()
            return arr

    def _cached(self, part: int) -> np.ndarray | None:
        with self._lock:
            if part in self._bad:
                raise self._bad[part].again()
            arr = self._maps.get(part)
            if arr is not None:
                self._maps.move_to_end(part)
            return arr

    def _part_lock(self, part: int) -> threading.Lock:
        with self._lock:
            return self._part_locks.setdefault(part, threading.Lock())

    def bad_parts(self) -> dict[int, str]:
        """Parts with no good copy, and why (what the loader withholds)."""
        with self._lock:
            return {k: e.reason for k, e in self._bad.items()}

    def take_repairs(self) -> list[dict[str, Any]]:
        """Parts served after a failed read since the last call (cleared by this call):
        ``part``, ``file``, ``via`` (``reread`` or the mirror's URL), ``manifest`` and
        ``found`` (the SHA-256 the failed read had, None when it could not be read) and
        ``error`` (the failed read's reason)."""
        with self._lock:
            out, self._repairs = self._repairs, []
        return out

    def inject_corrupt(self, part: int) -> None:
        """Fault injection (``corrupt_part``): from now on every read of ``part``'s primary
        copy by this process has one byte flipped, as a corrupt disk or a bad transfer
        would give it; the part is read again at its next use. The file is not touched
        (another process may have it mapped)."""
        with self._part_lock(part), self._lock:
            self._injected.add(part)
            self._drop(part)
            self._bad.pop(part, None)

    # -- a failed part: read again, then the mirrors ---------------------------------------

    def _recover(self, part: int) -> np.ndarray:
        try:
            return self._open(part)
        except PartError as e:
            first = e
        log.warning("data: %s; reading it again", first)
        with self._lock:
            self._drop(part)
        try:
            arr = self._open(part)
        except PartError as e:
            return self._from_mirrors(part, e)
        self._note_repair(part, "reread", first)
        return arr

    def _from_mirrors(self, part: int, failed: PartError) -> np.ndarray:
        info = self.manifest.parts[part]
        if info.source is not None or not self.mirrors:
            why = "imported in place: no mirror holds it" if info.source else "no data.mirrors"
            raise failed.with_note(why)
        tried = []
        for mirror in self.mirrors:
            try:
                arr = self._mirror_copy(part, info, mirror)
            except PartError as e:
                log.warning("data: mirror %s: %s", mirror, e.reason)
                tried.append(f"{mirror}: {e.reason}")
                continue
            self._note_repair(part, mirror, failed)
            log.warning("data: %s; served the copy of %s instead", failed, mirror)
            return arr
        raise failed.with_note("no good copy in data.mirrors (" + "; ".join(tried) + ")")

    def _mirror_copy(self, part: int, info: PartInfo, mirror: str) -> np.ndarray:
        """The part from ``mirror`` into the cache, checked against the manifest."""
        fs, root = open_fs(mirror, self.policy.timeout_s)
        url = f"{mirror}/{info.file}"
        if self.cache_root is None:
            self.cache_root = self._cache_root(self._cache_dir)
        dest = self.cache_root / f"{info.file}.mirror"
        self._download(fs, f"{root.rstrip('/')}/{info.file}", dest, url, part, info.bytes)
        try:
            arr = _map(str(dest), *self._layout(info))
        except (OSError, ValueError) as e:
            dest.unlink(missing_ok=True)
            raise PartError(part, url, f"cannot be mapped ({e})") from None
        digest = hashlib.sha256(arr.data).hexdigest()
        if digest != info.sha256:
            dest.unlink(missing_ok=True)
            raise PartError(part, url, f"checksum mismatch (manifest {info.sha256}, "
                             f"file {digest})", found=digest)  # fmt: skip
        with self._lock:
            self._from_mirror[part] = str(dest)
            self._verified.add(part)
        return arr

    def _note_repair(self, part: int, via: str, failed: PartError) -> None:
        info = self.manifest.parts[part]
        record = {
            "part": part,
            "file": self.url(part),
            "via": via,
            "manifest": info.sha256,
            "found": failed.found,
            "error": failed.reason,
        }
        with self._lock:
            self._repairs.append(record)

    def _drop(self, part: int) -> None:
        """Forget what this process holds of ``part`` (lock held): read it afresh."""
        self._maps.pop(part, None)
        self._verified.discard(part)
        repaired = self._from_mirror.pop(part, None)
        if repaired is not None:
            Path(repaired).unlink(missing_ok=True)
        if self.cache_root is not None and part < len(self.manifest.parts):
            (self.cache_root / self.manifest.parts[part].file).unlink(missing_ok=True)

    def cached_bytes(self) -> int:
        return sum(a.nbytes for a in self._maps.values()) if not self.local else 0

    def _layout(self, info: PartInfo) -> tuple[np.dtype, tuple[int, ...]]:
        m = self.manifest
        if m.structured:
            return m.record_dtype(), (info.samples,)
        return m.np_dtype(), (info.samples, m.seq_len + 1)

    def _open(self, part: int) -> np.ndarray:
        info = self.manifest.parts[part]
        if info.source is not None:
            return self._open_in_place(part)
        path = self.root + "/" + info.file if self.local else self._fetch(part)
        path = path.removeprefix("file://")
        try:
            arr = _map(path, *self._layout(info))
        except (OSError, ValueError) as e:
            raise PartError(part, self.url(part), f"cannot be mapped ({e})") from None
        if part in self._injected:  # chaos: the primary copy reads with one byte flipped
            arr = _flipped(arr)
        if part not in self._verified:
            digest = hashlib.sha256(arr.data).hexdigest()
            if digest != info.sha256:
                raise PartError(part, self.url(part), f"checksum mismatch (manifest "
                                 f"{info.sha256}, file {digest})", found=digest)  # fmt: skip
            self._verified.add(part)
        return arr

    def _open_in_place(self, part: int) -> np.ndarray:
        """An in-place part: its source file where it lies (a remote one fetched whole into
        the cache), checked whole against the size and SHA-256 recorded at import, so a
        file changed since is refused with its name."""
        info = self.manifest.parts[part]
        src = info.source
        assert src is not None
        fs, path = open_fs(src.url, self.policy.timeout_s)
        if not is_local(fs.protocol):
            if self.cache_root is None:
                self.cache_root = self._cache_root(None)
            path = self._fetch(part, fs, src.url)
        m = self.manifest
        try:
            whole = _map(path.removeprefix("file://"), np.dtype(np.uint8), (src.size,))
        except FileNotFoundError:
            raise PartError(part, src.url, "missing (imported in place from there)") from None
        except (OSError, ValueError) as e:
            raise PartError(
                part, src.url, f"changed since it was imported in place ({e})"
            ) from None
        if part not in self._verified:
            digest = hashlib.sha256(whole.data).hexdigest()
            if digest != info.sha256:
                why = f"SHA-256 {digest[:12]}..., recorded {info.sha256[:12]}..."
                raise PartError(part, src.url, f"changed since it was imported in place ({why})")
            self._verified.add(part)
        rows = whole[src.offset : src.offset + info.bytes]
        return rows.view(m.np_dtype()).reshape(info.samples, m.seq_len + 1)

    def _fetch(self, part: int, fs: Any = None, url: str | None = None) -> str:
        assert self.cache_root is not None
        info = self.manifest.parts[part]
        dest = self.cache_root / info.file
        want = info.source.size if info.source is not None else info.bytes
        if dest.exists() and dest.stat().st_size == want:
            return str(dest)
        src_fs, src_url = (self.fs, f"{self.root}/{info.file}") if fs is None else (fs, url)
        if info.source is not None and fs is None:
            src_url = self.url(part)
        assert src_url is not None
        self._download(src_fs, src_url, dest, self.url(part), part, want)
        self._verified.discard(part)
        return str(dest)

    def _download(self, fs: Any, path: str, dest: Path, name: str, part: int, size: int) -> None:
        """``path`` of ``fs`` whole into ``dest`` (a temporary name, then a rename), each
        try from the start, with the remote read policy; PartError naming ``name``.
        Over HTTP: one streamed GET of known size (no HEAD first, whose failure fsspec
        reports as a missing file; no range requests, which not every server answers)."""
        assert self.cache_root is not None
        stream = {"block_size": 0, "size": size} if is_http(fs.protocol) else {}

        def once() -> None:
            fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=self.cache_root)
            try:
                with os.fdopen(fd, "wb") as out, fs.open(path, "rb", **stream) as src:
                    shutil.copyfileobj(src, out, CHUNK)
                os.replace(tmp, dest)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)

        try:
            with_retries(once, f"part {part} ({name})", self.policy, counter=self.retries)
        except FileNotFoundError:
            raise PartError(part, name, "missing") from None
        except ReadFailed as e:
            raise PartError(part, name, f"cannot be read ({e.attempts} tries; last: "
                             f"{type(e.last).__name__}: {e.last})") from None  # fmt: skip
        except OSError as e:
            raise PartError(part, name, f"cannot be read ({e})") from None
        self.downloads += 1

    def _evict(self) -> None:
        if self.local:
            return
        while len(self._maps) > 1 and self.cached_bytes() > self.cache_bytes:
            part, _ = self._maps.popitem(last=False)
            assert self.cache_root is not None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cache_root / self.manifest.parts[part].file)
            repaired = self._from_mirror.pop(part, None)
            if repaired is not None:
                Path(repaired).unlink(missing_ok=True)
            self._verified.discard(part)
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


def _flipped(arr: np.ndarray) -> np.ndarray:
    """A private copy of ``arr`` with its middle byte inverted (fault injection)."""
    out = arr.copy()
    raw = out.view(np.uint8).reshape(-1)
    if raw.size:
        raw[raw.size // 2] ^= 0xFF
    out.setflags(write=False)
    return out


def open_fs(url: str, timeout_s: float | None = None) -> tuple[Any, str]:
    """fsspec file system and root path of a dataset URL (a plain path is local);
    ``timeout_s``: the deadline of one request where the protocol takes one (HTTP)."""
    fs, path = fsspec.core.url_to_fs(url, **storage_options(url, timeout_s))
    return fs, path
