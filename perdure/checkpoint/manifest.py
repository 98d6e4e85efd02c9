"""Reading, checking and sealing a manifest: the commit record and index of a checkpoint.

Since format 1.1 the manifest carries its own checksum, the *seal*: its file ends with
the fixed-length member ``"manifest_checksum": "sha256:<hex>"``, the SHA-256 of every byte
before it. The seal is inside the one file whose rename commits a checkpoint, so the
commit stays a single atomic step, and the file stays plain JSON that a 1.0 reader reads
(it ignores the unknown field). A manifest without a seal is accepted only as format 1.0,
with a :class:`LegacyManifestWarning`; every structural rule applies to both.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from pathlib import Path
from typing import Any

from perdure.checkpoint import layout
from perdure.checkpoint.codec import loads_strict
from perdure.checkpoint.errors import (
    CorruptCheckpointError,
    FormatVersionError,
    LegacyManifestWarning,
)
from perdure.checkpoint.rules import check_manifest

SEAL_KEY = "manifest_checksum"
_SEAL_RE = re.compile(rb' "manifest_checksum": "sha256:([0-9a-f]{64})"\n}\n\Z')
SEAL_BYTES = len(b' "manifest_checksum": "sha256:"\n}\n') + 64
"""The seal is the last ``SEAL_BYTES`` bytes of a sealed manifest."""
MAX_MANIFEST = 256 << 20
"""A manifest above this size is refused before it is read (real ones are kilobytes to a
few megabytes: about 200 bytes per tensor chunk)."""


def seal_line(prefix: bytes) -> bytes:
    """The seal that closes a manifest whose bytes before it are ``prefix``."""
    digest = hashlib.sha256(prefix).hexdigest()
    return b' "' + SEAL_KEY.encode() + b'": "sha256:' + digest.encode() + b'"\n}\n'


def encode_manifest(m: dict[str, Any]) -> bytes:
    """The sealed bytes of manifest ``m``: indented JSON, ``manifest_checksum`` last."""
    assert SEAL_KEY not in m and m, "the writer seals a fresh, non-empty manifest"
    body = json.dumps(m, indent=1, allow_nan=False)
    assert body.endswith("\n}")
    prefix = (body[:-2] + ",\n").encode()
    return prefix + seal_line(prefix)


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``, checked: seal (or format 1.0),
    format and major version, and every structural rule (:mod:`perdure.checkpoint.rules`);
    unknown fields are kept and ignored. Any failure raises the format's error naming
    the manifest and the rule."""
    path = Path(path)
    mpath = path / layout.MANIFEST
    where = str(mpath)
    data = _read_bounded(mpath)
    sealed = _check_seal(data, where)
    m = loads_strict(data, where)
    if not isinstance(m, dict):
        raise CorruptCheckpointError(where, "not a JSON object")
    check_version(m, where)
    if sealed and m.get(SEAL_KEY) != sealed:
        raise CorruptCheckpointError(where, f"field {SEAL_KEY!r} disagrees with the seal")
    if not sealed:
        _unsealed(m, where)
    check_manifest(m, where, layout.step_of(path))
    return m


def _read_bounded(mpath: Path) -> bytes:
    try:
        with open(mpath, "rb") as f:
            data = f.read(MAX_MANIFEST + 1)
    except FileNotFoundError:
        raise CorruptCheckpointError(
            str(mpath), "missing: the checkpoint is not committed"
        ) from None
    except OSError as e:
        raise CorruptCheckpointError(str(mpath), f"unreadable ({e.strerror or e})") from None
    if len(data) > MAX_MANIFEST:
        raise CorruptCheckpointError(str(mpath), f"larger than {MAX_MANIFEST} bytes")
    return data


def _check_seal(data: bytes, where: str) -> str | None:
    """``sha256:<hex>`` of a sealed manifest whose seal matches, None when it has none."""
    match = _SEAL_RE.search(data, max(0, len(data) - SEAL_BYTES))
    if match is None:
        return None
    want = match.group(1).decode()
    got = hashlib.sha256(data[: match.start()]).hexdigest()
    if got != want:
        raise CorruptCheckpointError(
            where,
            f"checksum mismatch: the manifest's seal says sha256 {want}, its bytes have {got}",
        )
    return "sha256:" + want


def _unsealed(m: dict[str, Any], where: str) -> None:
    """A manifest without a seal is a format 1.0 one (read with a note) or corrupt."""
    minor = m["version"].get("minor")
    if type(minor) is not int or minor >= layout.SEALED_SINCE_MINOR:
        raise CorruptCheckpointError(
            where,
            f"no valid seal: a format 1.{minor} manifest must end with its "
            f'"{SEAL_KEY}": "sha256:<64 hex>" (damaged or hand-edited?)',
        )
    warnings.warn(
        LegacyManifestWarning(
            f"{where}: format 1.0 manifest without a checksum of its own; its structure was "
            "checked, but re-save this checkpoint to seal it"
        ),
        stacklevel=3,
    )


def check_version(m: dict[str, Any], where: str) -> None:
    if m.get("format") != layout.FORMAT_NAME:
        raise FormatVersionError(
            f"{where}: format is {m.get('format')!r:.80}, expected {layout.FORMAT_NAME!r}"
        )
    v = m.get("version")
    major = v.get("major") if isinstance(v, dict) else None
    minor = v.get("minor") if isinstance(v, dict) else None
    if type(major) is not int or major != layout.FORMAT_MAJOR:
        raise FormatVersionError(
            f"{where}: format version {major!r:.20}.{minor!r:.20} is not supported: this "
            f"reader knows major version {layout.FORMAT_MAJOR} (minor versions only add "
            "optional fields)"
        )
    if type(minor) is not int or minor < 0:
        raise CorruptCheckpointError(where, f"version minor {minor!r:.20} is not an int >= 0")


def split_checksum(value: str, where: str) -> tuple[str, str]:
    algo, _, digest = value.partition(":")
    if algo != layout.CHECKSUM_ALGORITHM or len(digest) != 8:
        raise CorruptCheckpointError(
            where, f"unsupported checksum {value!r} (expected crc32:<8 hex>)"
        )
    return algo, digest
