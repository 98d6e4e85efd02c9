"""Names on disk: step directories, temporary directories, part files, the manifest.

One module holds every name so that the writer, the loader, discovery and the spec
(docs/checkpoint-format.md) cannot drift apart.
"""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_NAME = "perdure-checkpoint"
FORMAT_MAJOR = 1
FORMAT_MINOR = 1
"""1.1 seals the manifest with its own SHA-256 (``manifest.SEAL_KEY``); 1.0 had none."""
SEALED_SINCE_MINOR = 1
MANIFEST = "manifest.json"
CONTEXT = "context.json"
CHECKSUM_ALGORITHM = "crc32"
STEP_DIGITS = 9
MAX_COUNT = 1 << 53
"""Every size, step, row and dimension in a manifest is an int in ``[0, 2**53)``: exact in
any JSON reader (a double holds it) and far above any real tensor."""

DTYPE_SIZES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U64": 8,
    "U32": 4,
    "U16": 2,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
"""Bytes per element of each safetensors dtype the format allows (spec, section 4)."""

_STEP_RE = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    """``step-000001200``: zero-padded so that names sort like steps."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0 (got {step})")
    return f"step-{step:0{STEP_DIGITS}d}"


def tmp_dir_name(step: int, token: str) -> str:
    """Where the writers of one save attempt put their files before the commit."""
    return f"{step_dir_name(step)}.tmp-{token}"


def part_file_name(rank: int, world: int) -> str:
    return f"tensors-{rank:05d}-of-{world:05d}.safetensors"


def step_of(path: str | Path) -> int | None:
    """The step of a committed-directory name, or None for anything else."""
    m = _STEP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None
