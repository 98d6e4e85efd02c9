"""Names on disk: step directories, temporary directories, part files, the manifest.

One module holds every name so that the writer, the loader, discovery and the spec
(docs/checkpoint-format.md) cannot drift apart.
"""

from __future__ import annotations

import re
from pathlib import Path

FORMAT_NAME = "perdure-checkpoint"
FORMAT_MAJOR = 1
FORMAT_MINOR = 0
MANIFEST = "manifest.json"
CONTEXT = "context.json"
CHECKSUM_ALGORITHM = "crc32"
STEP_DIGITS = 9

_STEP_RE = re.compile(r"^step-(\d+)$")
_TMP_RE = re.compile(r"^step-(\d+)\.tmp-[0-9a-f]+$")


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


def tmp_step_of(path: str | Path) -> int | None:
    """The step of a temporary directory name, or None for anything else."""
    m = _TMP_RE.match(Path(path).name)
    return int(m.group(1)) if m else None
