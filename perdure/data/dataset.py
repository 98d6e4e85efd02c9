"""``Dataset``: a built dataset opened from any fsspec URL, read by sample id."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from perdure.data.errors import DataError, PartError
from perdure.data.fields import TOKENS, served_dtype
from perdure.data.manifest import MANIFEST_NAME, Manifest, parse_manifest
from perdure.data.retry import ReadFailed, ReadPolicy, with_retries
from perdure.data.store import PartStore, is_local, open_fs

T = TypeVar("T")

SHORT_ROWS = 512
"""Below this seq_len a read minimises numpy calls; at or above it, bytes copied."""


class Dataset:
    """Random access to the samples of one dataset version.

    Samples are numbered across parts in part order; part ``k`` holds ids
    ``[start_k, start_k + samples_k)``. Opening reads only ``manifest.json`` and one listing
    of the dataset directory (to report missing or truncated parts up front); part bytes
    are read when a sample needs them (see :mod:`perdure.data.store`).
    """

    def __init__(self, url: str, manifest: Manifest, store: PartStore) -> None:
        self.url, self.manifest, self.store = url, manifest, store
        counts = np.array([s.samples for s in manifest.parts], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
        self._ends = self.starts + counts
        self._documents: np.ndarray | None = None

    @classmethod
    def open(
        cls,
        url: str,
        *,
        cache_dir: str | None = None,
        cache_mb: int = 1024,
        check_files: bool = True,
        mirrors: tuple[str, ...] = (),
        policy: ReadPolicy | None = None,
    ) -> Dataset:
        """Open the dataset at ``url`` (directory holding ``manifest.json``).

        Raises :class:`DataError` naming the file for a missing or malformed manifest, and,
        when ``check_files``, for a missing part or one whose size differs from the
        manifest's. ``mirrors``: copies a failed part is repaired from (``data.mirrors``);
        ``policy``: how remote requests are tried (``perdure.data.retry``).
        """
        policy = policy or ReadPolicy()
        fs, root = open_fs(url, policy.timeout_s)
        root = root.rstrip("/")
        murl = f"{url.rstrip('/')}/{MANIFEST_NAME}"
        try:
            text = _remote(fs, policy, murl, lambda: fs.cat_file(f"{root}/{MANIFEST_NAME}"))
            text = text.decode()
        except FileNotFoundError:
            raise DataError(f"{murl}: missing (is {url} a dataset built by perdure?)") from None
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{murl}: cannot be read ({e})") from None
        manifest = parse_manifest(text, murl)
        if check_files:
            _check_files(fs, root, url, manifest, policy)
        store = PartStore(
            fs, root, manifest, cache_dir=cache_dir, cache_mb=cache_mb, mirrors=mirrors,
            policy=policy,
        )  # fmt: skip
        return cls(url, manifest, store)

    @property
    def version_id(self) -> str:
        return self.manifest.version_id

    @property
    def num_samples(self) -> int:
        return int(self._ends[-1])

    @property
    def seq_len(self) -> int:
        return self.manifest.seq_len

    @property
    def num_parts(self) -> int:
        return len(self.manifest.parts)

    def part_of(self, sample_id: int | np.ndarray) -> int | np.ndarray:
        """Part of a sample id (or of each id of an array)."""
        ids = np.asarray(sample_id, dtype=np.int64)
        self._check_ids(ids)
        out = np.searchsorted(self.starts, ids, side="right") - 1
        return int(out) if out.ndim == 0 else out

    def parts_unchecked(self, ids: np.ndarray) -> np.ndarray:
        """Part of each id, for ids known to be in range (the loader's own)."""
        return np.searchsorted(self.starts, ids, side="right") - 1

    def part_range(self, part: int) -> tuple[int, int]:
        """Sample ids ``[start, end)`` of a part."""
        return int(self.starts[part]), int(self._ends[part])

    def read(self, sample_ids: np.ndarray) -> np.ndarray:
        """Rows ``[n, seq_len + 1]`` (stored dtype) of ``sample_ids``; raises PartError."""
        rows, bad = self.read_available(np.asarray(sample_ids, dtype=np.int64))
        if bad:
            raise next(iter(bad.values()))
        return rows

    def read_available(
        self,
        ids: np.ndarray,
        dtype: np.dtype | type | None = None,
        parts: np.ndarray | None = None,
    ) -> tuple[np.ndarray, dict[int, PartError]]:
        """Token rows of ``ids`` (converted to ``dtype`` while copied, default: stored dtype),
        with the rows of unreadable parts left zero and those parts' errors returned instead
        of raised (the slot loader's path). ``parts``: ``part_of(ids)`` if already known."""
        if not self.manifest.tokens:
            names = [f.name for f in self.manifest.fields]
            raise DataError(f"{self.url}: holds no {TOKENS!r} field (its fields: {names}); "
                            "read_fields reads them")  # fmt: skip
        if self.manifest.structured:
            records, bad = self.read_records(ids, parts)
            return records[TOKENS].astype(dtype or self.manifest.np_dtype()), bad
        out = np.empty((ids.size, self.seq_len + 1), dtype=dtype or self.manifest.np_dtype())
        return out, self._read_into(out, ids, parts)

    def read_records(
        self, ids: np.ndarray, parts: np.ndarray | None = None
    ) -> tuple[np.ndarray, dict[int, PartError]]:
        """Whole samples of ``ids`` as records of every field (``manifest.record_dtype()``);
        unreadable parts as in :meth:`read_available`."""
        out = np.empty(ids.size, dtype=self.manifest.record_dtype())
        if not self.manifest.structured:  # one field: the record is the token row
            out[TOKENS], bad = self.read_available(ids, None, parts)
            return out, bad
        return out, self._read_into(out, ids, parts)

    def read_fields(
        self, ids: np.ndarray, parts: np.ndarray | None = None
    ) -> tuple[dict[str, np.ndarray], dict[int, PartError]]:
        """Every field of ``ids`` by name, in the dtype a task receives
        (:func:`~perdure.data.fields.served_dtype`: integers as int64); unreadable parts as
        in :meth:`read_available`."""
        if not self.manifest.structured:  # the common case keeps the cast-while-copying path
            tokens, bad = self.read_available(ids, np.int64, parts)
            return {TOKENS: tokens}, bad
        records, bad = self.read_records(ids, parts)
        return {f.name: records[f.name].astype(served_dtype(f.dtype))
                for f in self.manifest.fields}, bad  # fmt: skip

    def _read_into(
        self, out: np.ndarray, ids: np.ndarray, parts: np.ndarray | None
    ) -> dict[int, PartError]:
        """Fill ``out`` (token rows or records, one per id) from the parts."""
        if parts is None:  # given parts mean ids the caller already checked
            self._check_ids(ids)
            parts = np.searchsorted(self.starts, ids, side="right") - 1
        bad: dict[int, PartError] = {}
        if ids.size == 0:
            return bad
        rows = ids - self.starts[parts]
        lo, hi = int(parts.min()), int(parts.max())
        if lo == hi:
            out[:] = self._gather(lo, rows, bad)
            return bad
        order = np.argsort(parts, kind="stable")
        ks, rs = parts[order], rows[order]
        cuts = [0, *(np.flatnonzero(np.diff(ks)) + 1).tolist(), ids.size]
        spans = list(zip(ks[cuts[:-1]].tolist(), cuts[:-1], cuts[1:], strict=True))
        if self.seq_len < SHORT_ROWS:
            # Short rows: numpy call overhead dominates, so gather per part into a list,
            # concatenate, and scatter (with the dtype cast) once.
            out[order] = np.concatenate([self._gather(k, rs[a:b], bad) for k, a, b in spans])
        else:
            # Long rows: bandwidth dominates, so copy each row only twice.
            for k, a, b in spans:
                out[order[a:b]] = self._gather(k, rs[a:b], bad)
        return bad

    def _gather(self, part: int, rows: np.ndarray, bad: dict[int, PartError]) -> np.ndarray:
        try:
            return self.store.rows(part)[rows]
        except PartError as e:
            bad[part] = e
            m = self.manifest
            if m.structured:
                return np.zeros(rows.size, dtype=m.record_dtype())
            return np.zeros((rows.size, self.seq_len + 1), dtype=m.np_dtype())

    def _check_ids(self, ids: np.ndarray) -> None:
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.num_samples):
            lo, hi = int(ids.min()), int(ids.max())
            raise DataError(
                f"{self.url}: sample ids must be in [0, {self.num_samples}) (got [{lo}, {hi}])"
            )

    def documents(self) -> np.ndarray:
        """Where documents start, as token offsets into the stream of samples (sample ``i``
        is stream ``[i * (seq_len + 1), (i + 1) * (seq_len + 1))``); from ``documents.bin``
        of a Megatron or MDS import, checked against its SHA-256 on first use."""
        if self._documents is None:
            entry = self.manifest.build.get("documents")
            if not isinstance(entry, dict):
                raise DataError(f"{self.url}: holds no document boundaries (only Megatron and "
                                "MDS imports record them)")  # fmt: skip
            fs, root = open_fs(self.url)
            where = f"{self.url.rstrip('/')}/{entry['file']}"
            try:
                data = fs.cat_file(f"{root.rstrip('/')}/{entry['file']}")
            except (OSError, FileNotFoundError) as e:
                raise DataError(f"{where}: cannot be read ({e})") from None
            if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
                raise DataError(f"{where}: checksum does not match manifest.json")
            self._documents = np.frombuffer(data, dtype="<i8").astype(np.int64)
        return self._documents

    def doc_fields(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Per token of each sample of ``ids``: ``doc_ids`` (0 for the document the sample
        starts in, +1 at each boundary inside it) and ``position_ids`` (counting from the
        document's start, or from the sample's start for a document begun before it), both
        int64 ``[n, seq_len + 1]``: what intra-document attention masks are made from."""
        starts = self.documents()
        row = self.seq_len + 1
        first = np.asarray(ids, dtype=np.int64)[:, None] * row
        pos = first + np.arange(row, dtype=np.int64)
        d = np.searchsorted(starts, pos, side="right") - 1
        begin = np.where(d >= 0, starts[np.maximum(d, 0)] if starts.size else 0, 0)
        return {"doc_ids": d - d[:, :1], "position_ids": pos - np.maximum(begin, first)}

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Dataset:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _remote(fs: Any, policy: ReadPolicy, what: str, call: Callable[[], T]) -> T:
    """``call()``, tried again with backoff where ``fs`` is remote (``data/retry.py``)."""
    if is_local(fs.protocol):
        return call()
    return with_retries(call, what, policy)


def _check_files(fs: Any, root: str, url: str, manifest: Manifest, policy: ReadPolicy) -> None:
    try:
        listing = _remote(fs, policy, url, lambda: fs.ls(root, detail=True))
    except FileNotFoundError:
        raise DataError(f"{url}: directory missing") from None
    except ReadFailed as e:
        raise DataError(f"{url}: cannot be listed ({e})") from None
    sizes = {str(e["name"]).rstrip("/").rsplit("/", 1)[-1]: e.get("size") for e in listing}
    base = url.rstrip("/")
    for info in manifest.parts:
        if info.source is not None:
            _check_source(info.source.url, info.source.size)
            continue
        if info.file not in sizes:
            raise DataError(f"{base}/{info.file}: part file missing (listed in manifest.json)")
        size = sizes[info.file]
        if size is not None and size != info.bytes:
            raise DataError(
                f"{base}/{info.file}: size must be {info.bytes} bytes as manifest.json says "
                f"(got {size}; truncated, or written with another dtype or seq_len?)"
            )


def _check_source(url: str, size: int) -> None:
    """An in-place part's file: present, and the size it had when imported."""
    fs, path = open_fs(url)
    try:
        got = fs.size(path)
    except FileNotFoundError:
        raise DataError(
            f"{url}: missing (imported in place; manifest.json references it)"
        ) from None
    if got != size:
        raise DataError(f"{url}: changed since it was imported in place (size {got} bytes, "
                        f"recorded {size}); import it again")  # fmt: skip
