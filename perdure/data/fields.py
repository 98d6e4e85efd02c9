"""Named per-sample fields: what a sample holds (``Field``), what a task needs (``FieldSpec``).

A sample is a fixed-size record of named, fixed-shape numeric arrays stored one after the
other, packed, little-endian, in the order the manifest lists them: ``tokens`` first (always
there, 1-D unsigned integers, the ids the vocabulary counts), then any others (``labels``,
``loss_mask``, a per-sample class, ...). A tokens-only dataset is the format-version-1
layout unchanged: the record is one row of tokens.

What a task's ``loss_fn`` receives (``served_dtype``): ``tokens`` and every integer field
as int64 (embedding indices, ``cross_entropy`` targets; torch has little arithmetic for
uint16 and uint32), every float field in its stored dtype. So a ``uint8`` mask costs 8
bytes an element in a batch; that is a slot's batch, not the dataset.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from perdure.data.errors import DataError

TOKENS = "tokens"
"""The field every dataset has: token ids in ``[0, vocab_size)``."""

TOKEN_DTYPES = ("uint8", "uint16", "uint32")
"""Dtypes of the tokens field: the smallest that holds ``vocab_size - 1`` is chosen."""

FIELD_DTYPES = (
    "uint8",
    "int8",
    "uint16",
    "int16",
    "uint32",
    "int32",
    "int64",
    "float16",
    "float32",
    "float64",
)
"""Dtypes of any other field (no uint64: it does not fit the int64 a task receives)."""

RESERVED = ("weight",)
"""Names the runtime puts beside the fields in the batch a task receives."""

_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")


@dataclass(frozen=True)
class Field:
    """One field of every sample: its name, stored dtype (little-endian) and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def items(self) -> int:
        """Values per sample."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.items * np.dtype(self.dtype).itemsize

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}

    def describe(self) -> str:
        return f"{self.name}: {self.dtype} {list(self.shape)}"


def served_dtype(dtype: str) -> np.dtype:
    """The dtype a field reaches the task in (see the module docstring)."""
    return np.dtype(np.int64) if np.issubdtype(np.dtype(dtype), np.integer) else np.dtype(dtype)


def record_dtype(fields: tuple[Field, ...]) -> np.dtype:
    """The packed little-endian structured dtype of one sample (no alignment padding)."""
    return np.dtype([(f.name, np.dtype(f.dtype).newbyteorder("<"), f.shape) for f in fields])


def valid_name(name: object) -> bool:
    """A lower-case identifier of at most 64 characters, not a reserved name."""
    return isinstance(name, str) and bool(_NAME.fullmatch(name)) and name not in RESERVED


def check_name(name: str, where: str) -> None:
    """Raise naming ``where`` unless ``name`` is a valid field name (see ``valid_name``)."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DataError(
            f"{where}: field name must match [a-z_][a-z0-9_]* (at most 64 "
            f"characters) (got {name!r})"
        )
    if name in RESERVED:
        raise DataError(
            f"{where}: field name {name!r} is reserved (the runtime adds "
            f"{', '.join(RESERVED)} to every batch)"
        )


@dataclass(frozen=True)
class FieldSpec:
    """A field a task needs (``Task.fields``), checked by the launcher's preflight against
    the dataset's manifest before any worker starts.

    ``dtype``: a stored dtype (``"uint8"``, ``"float32"``, ...) or a kind, ``"integer"`` or
    ``"float"``; ``None`` accepts any. ``shape``: one entry per dimension, ``None`` for any
    length in that dimension; ``None`` accepts any shape. E.g. a loss mask as long as the
    tokens: ``FieldSpec(shape=(None,))``; a class label: ``FieldSpec("integer", ())``.
    """

    dtype: str | None = None
    shape: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        kinds = ("integer", "float", *FIELD_DTYPES)
        if self.dtype is not None and self.dtype not in kinds:
            raise ValueError(
                f"FieldSpec.dtype: must be one of {list(kinds)} or None (got {self.dtype!r})"
            )
        if self.shape is not None and not all(
            d is None or (isinstance(d, int) and d >= 0) for d in self.shape
        ):
            raise ValueError(
                f"FieldSpec.shape: each entry must be an integer >= 0 or None (got {self.shape!r})"
            )

    def mismatch(self, f: Field) -> str | None:
        """Why ``f`` does not fit this spec (naming both values), or None."""
        if self.dtype is not None and not _dtype_fits(self.dtype, f.dtype):
            return f"has dtype {f.dtype} in the dataset, the task needs {self.dtype}"
        if self.shape is not None and not _shape_fits(self.shape, f.shape):
            want = ["*" if d is None else d for d in self.shape]
            return f"has shape {list(f.shape)} in the dataset, the task needs {want}"
        return None


def _dtype_fits(want: str, got: str) -> bool:
    if want == "integer":
        return np.issubdtype(np.dtype(got), np.integer)
    if want == "float":
        return np.issubdtype(np.dtype(got), np.floating)
    return want == got


def _shape_fits(want: tuple[int | None, ...], got: tuple[int, ...]) -> bool:
    return len(want) == len(got) and all(
        w is None or w == g for w, g in zip(want, got, strict=True)
    )
