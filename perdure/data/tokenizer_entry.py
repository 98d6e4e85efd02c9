"""A tokenizer named by an import entry (``module:function``): ``perdure data build --tokenizer``.

The contract (``docs/data.md``, "The tokenizer contract"):

- ``ENTRY`` names a callable ``text: str -> sequence of int`` (a list, a numpy array, a
  1-D tensor). With ``--tokenizer-file PATH``, ``ENTRY`` is instead a *factory* called once
  as ``ENTRY(PATH)`` that returns such a callable (a ``tokenizers`` ``tokenizer.json``, a
  ``transformers`` directory, a SentencePiece model: anything on local disk).
- Optional attributes of the callable (plain values or zero-argument methods):
  ``vocab_size`` (or ``get_vocab_size()``): ids are then checked to be below it;
  ``eos_id``: the separator appended after every document, unless ``--separator`` says
  otherwise; ``identity``: any JSON value that names what the tokenizer is (a name, a
  version, a hash of its files), recorded in the build parameters.
- The tokenizer's identity enters the version id: the entry, what the callable reports,
  and the SHA-256 of ``--tokenizer-file`` (of every file under it, for a directory). So a
  changed tokenizer file or a changed reported identity is a changed dataset version even
  where the tokens happen to agree; a tokenizer whose code changes while it reports the
  same identity changes the version only through the tokens it produces.

Each document (source file) is decoded as UTF-8 (strictly: a file that is not UTF-8 is an
error naming it and the byte offset) and handed to the callable whole.
"""

from __future__ import annotations

import codecs
import hashlib
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from perdure.data.errors import DataError

MAX_ID = 2**32
"""Ids must fit the widest token dtype (uint32)."""


@dataclass(frozen=True)
class EntryTokenizer:
    """A loaded ``--tokenizer``: call it with a document's bytes to get its checked ids."""

    entry: str
    fn: Callable[[str], Any]
    vocab_size: int | None = None
    """What the callable reports (``vocab_size`` / ``get_vocab_size()``), or None."""
    eos_id: int | None = None
    identity: dict[str, Any] = field(default_factory=dict)
    """What names this tokenizer besides its entry: ``file`` (name, bytes, SHA-256 of
    ``--tokenizer-file``) and ``reported`` (its ``identity``); a build parameter, so it
    enters the version id."""

    def encode(self, data: bytes, source: str, final: bool = True) -> np.ndarray:
        """The ids of one document as a 1-D int64 array (not yet range-checked: the caller
        knows the vocabulary). ``final=False``: ``data`` may end inside a UTF-8 character
        (a source cut by ``max_mb``), and that partial character is dropped."""
        try:
            text = codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
        except UnicodeDecodeError as e:
            raise DataError(
                f"{source}: not UTF-8 text at byte {e.start} ({e.reason}); --tokenizer reads text"
            ) from None
        return self.encode_text(text, source)

    def encode_text(self, text: str, source: str) -> np.ndarray:
        """The ids of one document given as text (a record's field), as :meth:`encode`."""
        try:
            ids = self.fn(text)
        except Exception as e:
            raise DataError(
                f"{source}: --tokenizer {self.entry} raised {type(e).__name__}: {e}"
            ) from None
        return as_ids(ids, f"{source}: --tokenizer {self.entry}")


def as_ids(ids: object, where: str) -> np.ndarray:
    """``ids`` as a 1-D int64 array; raise naming ``where`` unless it is a sequence of ints."""
    if hasattr(ids, "detach") and hasattr(ids, "numpy"):  # a torch tensor
        ids = ids.detach().cpu().numpy()  # type: ignore[attr-defined]
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise DataError(f"{where} must return a sequence of integers ({e})") from None
    if arr.ndim == 1 and arr.size == 0:  # an empty document: [] is float64 to numpy
        return np.empty(0, dtype=np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        inner = f", first item {type(arr.flat[0]).__name__}" if arr.size else ""
        raise DataError(
            f"{where} must return a 1-D sequence of integers (got {type(ids).__name__} of "
            f"dtype {arr.dtype}, shape {list(arr.shape)}{inner})"
        )
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) >= MAX_ID):
        raise DataError(
            f"{where} returned ids outside [0, 2**32) (got [{int(arr.min())}, {int(arr.max())}])"
        )
    return arr.astype(np.int64, copy=False)


def load_tokenizer(entry: str, file: str | None = None) -> EntryTokenizer:
    """Import ``entry`` (``module:function``; the working directory is importable, as for
    ``python -m``), call it on ``file`` if given, and read what it reports."""
    obj = _resolve(entry)
    identity: dict[str, Any] = {}
    if file is not None:
        identity["file"] = file_identity(file)
        try:
            obj = obj(file)
        except DataError:
            raise
        except Exception as e:
            raise DataError(
                f"--tokenizer: {entry}({file!r}) raised {type(e).__name__}: {e}"
            ) from None
        if not callable(obj):
            raise DataError(
                f"--tokenizer: {entry}({file!r}) must return a callable "
                f"text -> ids (got {type(obj).__name__})"
            )
    vocab = _reported_int(obj, ("vocab_size", "get_vocab_size"), entry, minimum=1)
    eos = _reported_int(obj, ("eos_id",), entry, minimum=0)
    reported = _reported(obj, "identity", entry)
    if reported is not None:
        try:
            json.dumps(reported, sort_keys=True)
        except (TypeError, ValueError) as e:
            raise DataError(f"--tokenizer: {entry}'s identity must be a JSON value ({e})") from None
        identity["reported"] = reported
    return EntryTokenizer(entry, obj, vocab, eos, identity)


def file_identity(path: str) -> dict[str, Any]:
    """Name, size and SHA-256 of a tokenizer file; for a directory, of every file in it
    (sorted by relative POSIX path), so the record does not depend on where it lies."""
    p = Path(path)
    if p.is_file():
        data = p.read_bytes()
        return {"name": p.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    if p.is_dir():
        h, total = hashlib.sha256(), 0
        files = sorted(f for f in p.rglob("*") if f.is_file())
        for f in sorted(files, key=lambda f: f.relative_to(p).as_posix()):
            data = f.read_bytes()
            h.update(f"{f.relative_to(p).as_posix()}\0{len(data)}\0".encode())
            h.update(data)
            total += len(data)
        return {"name": p.name, "files": len(files), "bytes": total, "sha256": h.hexdigest()}
    raise DataError(f"--tokenizer-file: no such file or directory (got {path!r})")


def _resolve(entry: str) -> Callable[..., Any]:
    module, sep, name = entry.partition(":")
    if not sep or not module or not name:
        raise DataError(f"--tokenizer: must be module:function (got {entry!r})")
    if os.getcwd() not in sys.path:  # as `python -m` does: tokenizers live beside the data
        sys.path.append(os.getcwd())
    try:
        mod = importlib.import_module(module)
    except Exception as e:  # an ImportError, or whatever the module raises as it loads
        raise DataError(
            f"--tokenizer: cannot import module {module!r} ({type(e).__name__}: {e})"
        ) from None
    obj: Any = mod
    for part in name.split("."):
        obj = getattr(obj, part, None)
    if not callable(obj):
        raise DataError(f"--tokenizer: module {module!r} has no callable {name!r}")
    return obj  # type: ignore[no-any-return]


def _reported(obj: object, name: str, entry: str) -> Any:
    value = getattr(obj, name, None)
    if value is None:
        value = getattr(getattr(obj, "__self__", None), name, None)  # a bound method's owner
    if callable(value):
        try:
            value = value()
        except Exception as e:
            raise DataError(
                f"--tokenizer: {entry}.{name}() raised {type(e).__name__}: {e}"
            ) from None
    return value


def _reported_int(obj: object, names: tuple[str, ...], entry: str, minimum: int) -> int | None:
    for name in names:
        value = _reported(obj, name, entry)
        if value is None:
            continue
        ok = isinstance(value, int | np.integer) and not isinstance(value, bool)
        if not ok or not minimum <= int(value) <= MAX_ID:
            raise DataError(
                f"--tokenizer: {entry}.{name} must be an integer in "
                f"[{minimum}, 2**32] (got {value!r})"
            )
        return int(value)
    return None
