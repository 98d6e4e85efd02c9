"""Reading and checking a manifest: the commit record and the index of a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from perdure.checkpoint import layout
from perdure.checkpoint.errors import CorruptCheckpointError, FormatVersionError

_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "step": int,
    "files": dict,
    "tensors": dict,
    "context": str,
}


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``, checked for format, major
    version and the types of its required fields; unknown fields are kept and ignored."""
    mpath = Path(path) / layout.MANIFEST
    try:
        text = mpath.read_text()
    except FileNotFoundError:
        raise CorruptCheckpointError(
            str(mpath), "missing: the checkpoint is not committed"
        ) from None
    try:
        m = json.loads(text)
    except json.JSONDecodeError as e:
        raise CorruptCheckpointError(str(mpath), f"not valid JSON ({e})") from None
    if not isinstance(m, dict):
        raise CorruptCheckpointError(str(mpath), "not a JSON object")
    check_version(m, str(mpath))
    for key, tp in _REQUIRED.items():
        if not isinstance(m.get(key), tp):
            raise CorruptCheckpointError(str(mpath), f"field {key!r} is missing or not a {tp}")
    for name, rec in m["files"].items():
        ok = isinstance(rec, dict) and isinstance(rec.get("bytes"), int)
        if not ok or not isinstance(rec.get("checksum"), str) or "/" in name:
            raise CorruptCheckpointError(str(mpath), f"malformed files entry {name!r}: {rec!r}")
    return m


def check_version(m: dict[str, Any], where: str) -> None:
    if m.get("format") != layout.FORMAT_NAME:
        raise FormatVersionError(
            f"{where}: format is {m.get('format')!r}, expected {layout.FORMAT_NAME!r}"
        )
    v = m.get("version")
    major = v.get("major") if isinstance(v, dict) else None
    if major != layout.FORMAT_MAJOR:
        minor = v.get("minor") if isinstance(v, dict) else None
        raise FormatVersionError(
            f"{where}: format version {major}.{minor} is not supported: this reader knows "
            f"major version {layout.FORMAT_MAJOR} (minor versions only add optional fields)"
        )


def split_checksum(value: str, where: str) -> tuple[str, str]:
    algo, _, digest = value.partition(":")
    if algo != layout.CHECKSUM_ALGORITHM or len(digest) != 8:
        raise CorruptCheckpointError(
            where, f"unsupported checksum {value!r} (expected crc32:<8 hex>)"
        )
    return algo, digest
