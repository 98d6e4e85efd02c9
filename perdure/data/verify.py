"""Full verification of a dataset: every part streamed and hashed against the manifest.

Unlike the loader, which checks a part the first time it reads it, this reads every part
once, in chunks, without caching it: ``perdure data verify`` on a remote dataset costs one
pass over its bytes and no disk.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from perdure.data.dataset import Dataset
from perdure.data.errors import PartError
from perdure.data.store import CHUNK

Progress = Callable[[int, int], None]


def verify_dataset(ds: Dataset, progress: Progress | None = None) -> list[PartError]:
    """Errors of the parts whose bytes differ from the manifest (empty: all good)."""
    bad: list[PartError] = []
    store = ds.store
    for k, info in enumerate(ds.manifest.parts):
        url = store.url(k)
        try:
            digest, size = _hash(store.fs, url)
        except FileNotFoundError:
            bad.append(PartError(k, url, "missing"))
            continue
        except OSError as e:
            bad.append(PartError(k, url, f"cannot be read ({e})"))
            continue
        if size != info.bytes:
            bad.append(PartError(k, url, f"size {size} bytes, manifest says {info.bytes}"))
        elif digest != info.sha256:
            bad.append(PartError(k, url, f"checksum mismatch (manifest {info.sha256[:12]}..., "
                                          f"file {digest[:12]}...)"))  # fmt: skip
        if progress is not None:
            progress(k + 1, ds.num_parts)
    return bad


def _hash(fs: object, url: str) -> tuple[str, int]:
    h, size = hashlib.sha256(), 0
    with fs.open(url, "rb") as f:  # type: ignore[attr-defined]
        while chunk := f.read(CHUNK):
            h.update(chunk)
            size += len(chunk)
    return h.hexdigest(), size
